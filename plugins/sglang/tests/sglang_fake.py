"""``FakeSglangRuntime``: stands in for SGLang's runtime in CPU tests."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rollout_engines.weights.checkpoint import load_checkpoint
from rollout_engines_sglang._tensor_bucket import FlattenedTensorBucket
from rollout_engines_sglang.payloads import forking_serialize
from rollout_engines_sglang.runtime import SglangCallFailed


class FakeSglangRuntime:
    """A fake of SGLang's runtime (:class:`rollout_engines_sglang.runtime.SglangRuntime`).

    It is a fake because SGLang cannot run on this CPU machine: SGLang needs CUDA GPUs (its
    kernels, memory saver and scheduler are CUDA only). It keeps what the engine's logic depends
    on: the model's real weights (from the checkpoint) that updates are applied to, SGLang's
    flattened-bucket payload format (unpickled and rebuilt once per TP rank, as SGLang's ranks do),
    sleep that *releases* weights (waking hands back zeroed memory, like SGLang's uninitialised
    memory), and injected faults (an update that fails after being partly applied) that a healthy
    real engine does not produce on demand. Its "generation" is a deterministic function of the
    prompt and the weights, so tests can see which weights produced an output.
    """

    def __init__(self, model_dir: str | Path, *, tp_size: int = 1, cpu_backup: bool = False) -> None:
        from transformers import AutoTokenizer

        self.tp_size = tp_size
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.weights = load_checkpoint(model_dir, dtype=torch.float32)
        self.vocab_size: int | None = int(self.weights["model.embed_tokens.weight"].shape[0])
        self.context_length: int | None = 256
        self.cpu_backup = cpu_backup
        self.released: set[str] = set()
        self.paused = False
        self.flushes = 0
        self.generate_calls: list[dict[str, Any]] = []
        self.tensor_updates: list[int] = []  # payload count of each update_from_tensor call
        self.disk_updates: list[str] = []
        self.fail_update_at: int | None = None  # 1-based update call that fails after applying
        self.fail_disk = False
        self._updates = 0
        self.shut_down = False
        self.hang = False

    # ---- generation ----------------------------------------------------------------------------
    def fingerprint(self) -> int:
        return int(self.weights["model.embed_tokens.weight"].double().abs().sum().item() * 1000) % 9973

    async def generate(self, *, input_ids: list[list[int]], sampling_params: list[dict], **kw: Any) -> list[dict]:
        if self.released:
            raise RuntimeError(f"memory released ({sorted(self.released)}): SGLang would crash or read garbage")
        if self.hang:  # a scheduler that died mid-request: SGLang never answers it
            await asyncio.Event().wait()
        self.generate_calls.append({"input_ids": input_ids, "sampling_params": sampling_params, **kw})
        fp, outs = self.fingerprint(), []
        for k, (ids, sp) in enumerate(zip(input_ids, sampling_params, strict=True)):
            token = (sum(ids) + fp + k * (sp["temperature"] > 0)) % self.vocab_size
            out = [token] * sp["max_new_tokens"]
            meta: dict[str, Any] = {"finish_reason": {"type": "length", "length": len(out)}}
            if kw.get("return_logprob"):
                meta["output_token_logprobs"] = [(-0.5, t, None) for t in out]
            outs.append({"text": self.tokenizer.decode(out), "output_ids": out, "meta_info": meta})
        return outs

    async def flush_cache(self) -> None:
        self.flushes += 1

    async def pause(self) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False

    # ---- memory --------------------------------------------------------------------------------
    async def release_memory(self, tags: Sequence[str]) -> None:
        self.released |= set(tags)

    async def resume_memory(self, tags: Sequence[str]) -> None:
        self.released -= set(tags)
        if "weights" in tags and not self.cpu_backup:
            for t in self.weights.values():
                t.zero_()  # the memory is back, its old values are not

    # ---- weights -------------------------------------------------------------------------------
    def _load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            if name == "lm_head.weight" and name not in self.weights:
                continue  # tied to the embedding; SGLang's loader skips it too
            self.weights[name].copy_(t)

    def _count_and_maybe_fail(self) -> None:
        self._updates += 1
        if self.fail_update_at is not None and self._updates == self.fail_update_at:
            raise SglangCallFailed("SGLang update failed: injected fault after applying part of the bucket")

    async def update_from_tensor(self, payloads: list[bytes]) -> None:
        if len(payloads) != self.tp_size:
            raise ValueError(f"{len(payloads)} payloads for {self.tp_size} TP ranks")
        self.tensor_updates.append(len(payloads))
        rebuilt = []
        for blob in payloads:  # every rank unpickles its own payload once
            payload = pickle.loads(blob)
            bucket = FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"], metadata=payload["metadata"])
            rebuilt.append([(n, t.clone()) for n, t in bucket.reconstruct_tensors()])
        assert all([n for n, _ in r] == [n for n, _ in rebuilt[0]] for r in rebuilt)
        half = rebuilt[0][: max(1, len(rebuilt[0]) // 2)]
        self._load(half)
        self._count_and_maybe_fail()
        self._load(rebuilt[0])

    async def update_from_disk(self, path: str) -> None:
        from safetensors.torch import load_file

        self.disk_updates.append(path)
        if self.fail_disk:
            raise SglangCallFailed("SGLang update_weights_from_disk failed: injected fault")
        for f in sorted(Path(path).glob("*.safetensors")):
            self._load(list(load_file(str(f)).items()))

    async def init_weights_group(self, *a: Any, **k: Any) -> None:
        raise NotImplementedError("NCCL groups need GPUs")

    async def destroy_weights_group(self, group_name: str) -> None:
        return None

    async def update_from_distributed(self, *a: Any, **k: Any) -> None:
        raise NotImplementedError("NCCL groups need GPUs")

    def serialize(self, obj: Any) -> bytes:
        return forking_serialize(obj)

    def shutdown(self) -> None:
        self.shut_down = True
