"""A steady push's layout check (the same names, dtypes and shapes as the last push) keeps no
Python object per tensor alive: a MoE model has ~10k-19k tensors, and objects kept through a push
set off the interpreter's full collections (tens of milliseconds each, every few pushes)."""

from __future__ import annotations

import gc

import torch
from rollout_engines.weights.session import WeightSync


def _sync() -> WeightSync:
    # No engine and no sender: only the manifest planning is exercised here.
    return WeightSync([], None, transport="inproc", bucket_bytes=1 << 20, timeout_s=10,  # type: ignore[arg-type]
                      checksum="none", progress=False)


def _collections_during(fn, threshold: int = 100) -> tuple[int, object]:
    """Collections (of any generation) started while ``fn`` runs, with a young-generation threshold
    of ``threshold`` allocations."""
    seen = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    old = gc.get_threshold()
    gc.collect()
    gc.set_threshold(threshold, 10, 10)
    gc.callbacks.append(callback)
    try:
        result = fn()
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*old)
    return len(seen), result


def test_steady_layout_check_allocates_nothing_per_tensor():
    state = {f"layers.{i}.experts.{i % 64}.w": torch.empty(4, 3, dtype=torch.bfloat16) for i in range(3000)}
    sync = _sync()
    first, _ = sync._manifest(state.items(), None, 1)
    collections, (manifest, items) = _collections_during(lambda: sync._manifest(state.items(), None, 2))
    # the same layout, reused: the same tensor list object, the new version
    assert manifest.tensors is first.tensors and manifest.version == 2
    # 3000 tensors at a threshold of 100: a per-tensor key or list would start >= 30 collections
    assert collections <= 2, collections
    assert [n for n, _ in items] == list(state)


def test_a_changed_shape_or_dtype_is_a_new_layout():
    state = {f"w{i}": torch.zeros(2, 2) for i in range(10)}
    sync = _sync()
    first, _ = sync._manifest(state.items(), None, 1)
    state["w3"] = torch.zeros(2, 3)
    second, _ = sync._manifest(state.items(), None, 2)
    assert second.tensors is not first.tensors
    assert [tuple(t.shape) for t in second.tensors if t.name == "w3"] == [(2, 3)]
    state["w3"] = torch.zeros(2, 3, dtype=torch.float16)
    third, _ = sync._manifest(state.items(), None, 3)
    assert third.tensors is not second.tensors
    assert [t.dtype for t in third.tensors if t.name == "w3"] == ["float16"]
    fourth, _ = sync._manifest(state.items(), None, 4)
    assert fourth.tensors is third.tensors


def test_a_one_pass_iterable_is_listed_and_still_checked():
    state = {f"w{i}": torch.zeros(2, 2) for i in range(10)}
    sync = _sync()
    first, _ = sync._manifest(iter(list(state.items())), None, 1)
    second, items = sync._manifest((kv for kv in state.items()), None, 2)
    assert second.tensors is first.tensors
    assert [n for n, _ in items] == list(state)  # listed: the send can still read every tensor
    fewer = dict(list(state.items())[:9])
    third, _ = sync._manifest(iter(list(fewer.items())), None, 3)
    assert len(third.tensors) == 9
