"""The ``sglang_nccl`` control protocol over a real TCPStore (the NCCL data path needs GPUs): rank
layout across engines of different TP sizes, validation verdicts before any data, go-ahead and
abort per bucket."""

from __future__ import annotations

import threading

import pytest
import torch
from rollout_engines.errors import WeightSyncError
from rollout_engines.weights.manifest import TransportSpec, plan_manifest, specs_of
from rollout_engines.weights.transports import _store
from rollout_engines_sglang import transport as t


def test_layout_places_tp_ranks_after_the_trainer() -> None:
    assert t.layout({1: 2, 2: 1, 3: 4}) == ({1: 1, 2: 3, 3: 4}, 8)
    assert t.layout({1: 1}) == ({1: 1}, 2)


def _session(engines: int):
    store, spec = _store.host_store({}, timeout_s=10)
    kv = _store.session_store(store, "s1", spec["secret"])
    specs = [
        TransportSpec(
            transport="sglang_nccl", session_id="s1", rank_offset=o, world_size=engines + 1, timeout_s=5,
            options={**spec, "group_name": "g", "group_port": 1},
        )
        for o in range(1, engines + 1)
    ]
    return store, kv, specs


def test_engines_learn_their_real_offsets() -> None:
    store, kv, specs = _session(2)
    controls = [t.SglangNcclControl(s) for s in specs]
    got: dict[int, tuple[int, int]] = {}
    threads = [
        threading.Thread(target=lambda c=c, tp=tp: got.__setitem__(c.spec.rank_offset, c.register(tp)))
        for c, tp in zip(controls, (2, 3), strict=True)
    ]
    for th in threads:
        th.start()
    world, tp_sizes = t.publish_layout(kv, 2, timeout_s=5)
    for th in threads:
        th.join(10)
    assert (world, tp_sizes) == (6, {1: 2, 2: 3})
    assert got == {1: (1, 6), 2: (3, 6)}
    assert controls[0].group_name == "g" and controls[0].group_port == 1


def test_a_refusing_engine_stops_the_update_before_any_data() -> None:
    store, kv, specs = _session(2)
    a, b = (t.SglangNcclControl(s) for s in specs)
    manifest = plan_manifest(specs_of([("w", torch.zeros(4))]), version=3)
    a.verdict(manifest, None)
    b.verdict(manifest, "unknown tensor 'w'")
    with pytest.raises(WeightSyncError, match="offset 2 refused update v3: unknown tensor 'w'"):
        t.collect_verdicts(kv, manifest, 2, timeout_s=5)
    other = plan_manifest(specs_of([("w", torch.zeros(4))]), version=4)
    a.verdict(other, None)
    b.verdict(other, None)
    t.collect_verdicts(kv, other, 2, timeout_s=5)  # all agreed: no error


def test_engines_wait_for_each_bucket_or_the_abort() -> None:
    store, kv, specs = _session(1)
    (control,) = (t.SglangNcclControl(s) for s in specs)
    manifest = plan_manifest(specs_of([("w", torch.zeros(4)), ("v", torch.zeros(4))]), version=1, bucket_bytes=256)
    kv.set(f"go/{manifest.session_id}/0", "1")
    control.wait_go(manifest, 0)
    kv.set(f"abort/{manifest.session_id}", "trainer ran out of memory")
    with pytest.raises(WeightSyncError, match="aborted update v1: trainer ran out of memory"):
        control.wait_go(manifest, 1)


def test_timeout_names_the_bucket() -> None:
    store, kv, (spec,) = _session(1)
    control = t.SglangNcclControl(spec.model_copy(update={"timeout_s": 0.5}))
    manifest = plan_manifest(specs_of([("w", torch.zeros(4))]), version=2)
    with pytest.raises(WeightSyncError, match="bucket 0 of update v2 did not come") as info:
        control.wait_go(manifest, 0)
    assert info.value.bucket == 0


def test_other_backends_cannot_join_sglang_nccl() -> None:
    _, _, (spec,) = _session(1)
    with pytest.raises(WeightSyncError, match="only the 'sglang' backend"):
        t.SglangNcclReceiver(spec, rank=1)
