"""``FakeSglangRuntime``: stands in for SGLang's runtime in CPU tests."""

from __future__ import annotations

import asyncio
import importlib
import pickle
import threading
from collections.abc import AsyncIterator, Sequence
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
    prompt and the weights (and of the LoRA adapter a sequence names in ``lora_path``), so tests
    can see which weights produced an output.

    LoRA, as SGLang's tokenizer manager answers it (python/sglang/srt/managers/tokenizer_control_mixin.py
    and lora/lora_registry.py): ``load_lora_adapter_from_tensors`` with one flattened-bucket payload
    per rank registers a new name (a name already registered is refused), ``unload_lora_adapter``
    unregisters one (an unknown name is refused), a request naming an unregistered adapter fails.
    Refusals are ``success=False`` answers, which the runtime turns into ``SglangCallFailed``.

    Custom weight loaders (``weight_loaders``, SGLang's ``custom_weight_loader`` server argument):
    ``update_from_tensor`` with such a ``load_format`` does what SGLang's weight updater does: each
    rank unpickles its own payload, a list of ``(name, tensor)``, imports the loader by its dotted
    path and calls it with that rank's model (:class:`FakeModel`, whose ``load_weights`` writes
    into the fake's weights) and the list.
    """

    def __init__(self, model_dir: str | Path, *, tp_size: int = 1, cpu_backup: bool = False,
                 weight_loaders: tuple[str, ...] = ()) -> None:
        from transformers import AutoTokenizer

        self.tp_size = tp_size
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.weights = load_checkpoint(model_dir, dtype=torch.float32)
        self.vocab_size: int | None = int(self.weights["model.embed_tokens.weight"].shape[0])
        self._fingerprint: tuple[torch.Tensor, int, int] | None = None  # (embedding, its version, value)
        self.context_length: int | None = 256
        self.cpu_backup = cpu_backup
        self.released: set[str] = set()
        self.paused = False
        self.flushes = 0
        self.generate_calls: list[dict[str, Any]] = []
        self.tensor_updates: list[int] = []  # payload count of each update_from_tensor call
        self.weight_loaders = weight_loaders
        self.load_formats: list[str] = []  # load_format of each update_from_tensor call
        self.models = [FakeModel(self) for _ in range(tp_size)]  # one per TP rank
        self.disk_updates: list[str] = []
        self.fail_update_at: int | None = None  # 1-based update call that fails after applying
        self.fail_disk = False
        self._updates = 0
        self.shut_down = False
        self.hang = False
        self.loras: dict[str, dict[str, Any]] = {}  # SGLang name -> {"config", "tensors"}
        self.lora_calls: list[tuple[str, str]] = []  # ("load" | "unload", SGLang name)
        self.refuse_lora: str | None = None  # the error_message of the next load (injected)
        self.lora_users: dict[str, str] = {}  # rid -> SGLang name of the adapter it runs on

    # ---- generation ----------------------------------------------------------------------------
    def fingerprint(self) -> int:
        # Every step of every sequence reads it: recomputed only when the embedding changed (an
        # in-place write bumps the tensor's version), so a step costs its scripted sleep and not a
        # sum over the embedding, which slows badly on a crowded CPU.
        t = self.weights["model.embed_tokens.weight"]
        if self._fingerprint is None or self._fingerprint[0] is not t or self._fingerprint[1] != t._version:
            self._fingerprint = (t, t._version, int(t.double().abs().sum().item() * 1000) % 9973)
        return self._fingerprint[2]

    async def weights_checksum(self) -> str:
        """As SGLang's ``check_weights(action="checksum")``: a hash of every weight's bytes."""
        import hashlib

        h = hashlib.sha256()
        for name in sorted(self.weights):
            t = self.weights[name].contiguous()
            h.update(name.encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype.itemsize == 1 else t.numpy().tobytes())
        return h.hexdigest()

    def lora_shift(self, name: str | None) -> int:
        """What adapter ``name`` adds to every token (0 for the base model)."""
        if name is None:
            return 0
        if name not in self.loras:  # LoRARegistry.acquire raises; the request fails
            raise ValueError(f"The following requested LoRA adapters are not loaded: {name}")
        total = sum(float(t.double().abs().sum()) for t in self.loras[name]["tensors"].values())
        return 1 + int(total * 1000) % 997

    async def generate(self, *, input_ids: list[list[int]], sampling_params: list[dict], **kw: Any) -> list[dict]:
        if self.released:
            raise RuntimeError(f"memory released ({sorted(self.released)}): SGLang would crash or read garbage")
        if self.hang:  # a scheduler that died mid-request: SGLang never answers it
            await asyncio.Event().wait()
        self.generate_calls.append({"input_ids": input_ids, "sampling_params": sampling_params, **kw})
        fp, outs = self.fingerprint(), []
        loras = kw.get("lora_path") or [None] * len(input_ids)
        for k, (ids, sp) in enumerate(zip(input_ids, sampling_params, strict=True)):
            token = (sum(ids) + fp + self.lora_shift(loras[k]) + k * (sp["temperature"] > 0)) % self.vocab_size
            out = [token] * sp["max_new_tokens"]
            meta: dict[str, Any] = {"finish_reason": {"type": "length", "length": len(out)}}
            if kw.get("return_logprob"):
                meta["output_token_logprobs"] = [(-0.5, t, None) for t in out]
            outs.append({"text": self.tokenizer.decode(out), "output_ids": out, "meta_info": meta})
        return outs

    async def flush_cache(self) -> None:
        if self.paused and getattr(self, "live", None):
            # SGLang's Scheduler.flush_cache refuses unless it is fully idle: no running batch and
            # an empty waiting queue (requests paused in_place or retracted count).
            raise RuntimeError("Cache not flushed because there are pending requests")
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

    async def update_from_tensor(self, payloads: list[bytes], load_format: str = "flattened_bucket") -> None:
        if len(payloads) != self.tp_size:
            raise ValueError(f"{len(payloads)} payloads for {self.tp_size} TP ranks")
        self.tensor_updates.append(len(payloads))
        self.load_formats.append(load_format)
        if load_format != "flattened_bucket":
            if load_format not in self.weight_loaders:  # SGLang: NotImplementedError, success=False
                raise SglangCallFailed(f"SGLang update_weights_from_tensor failed: Unknown load_format={load_format}")
            module, _, func = load_format.rpartition(".")  # SGLang's dynamic_import
            loader = getattr(importlib.import_module(module), func)
            for model, blob in zip(self.models, payloads, strict=True):
                loader(model, pickle.loads(blob))  # each rank its own payload
            self._count_and_maybe_fail()
            return
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

    # ---- LoRA --------------------------------------------------------------------------------------
    async def load_lora_from_tensors(self, name: str, config: dict[str, Any], payloads: list[bytes]) -> None:
        if len(payloads) != self.tp_size:
            raise ValueError(f"{len(payloads)} payloads for {self.tp_size} TP ranks")
        self.lora_calls.append(("load", name))
        ranks = []
        for blob in payloads:  # every rank rebuilds its own copy, then keeps it on the CPU
            payload = pickle.loads(blob)
            bucket = FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"], metadata=payload["metadata"])
            ranks.append({n: t.clone() for n, t in bucket.reconstruct_tensors()})
        assert all(r.keys() == ranks[0].keys() for r in ranks)
        if self.refuse_lora is not None:
            message, self.refuse_lora = self.refuse_lora, None
            raise SglangCallFailed(f"SGLang load_lora_adapter_from_tensors failed: {message}")
        if name in self.loras:
            raise SglangCallFailed(f"SGLang load_lora_adapter_from_tensors failed: LoRA with name {name} already exists")
        self.loras[name] = {"config": dict(config), "tensors": ranks[0]}

    async def unload_lora(self, name: str) -> None:
        self.lora_calls.append(("unload", name))
        if name not in self.loras:
            raise SglangCallFailed(f"SGLang unload_lora_adapter failed: LoRA with name {name} does not exist")
        # SGLang would wait here for its requests on the adapter; the engine unloads only unused ones.
        running = [rid for rid, n in self.lora_users.items() if n == name]
        assert not running, f"adapter {name} unloaded while {running} run on it"
        del self.loras[name]

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


class FakeModel:
    """A TP rank's model in :class:`FakeSglangRuntime`: ``load_weights`` copies into the fake's
    weights (what custom weight loaders are handed)."""

    def __init__(self, runtime: FakeSglangRuntime) -> None:
        self.runtime = runtime
        self.load_calls: list[list[str]] = []  # names of each load_weights call

    def load_weights(self, weights: Any) -> None:
        named = list(weights)
        self.load_calls.append([n for n, _ in named])
        self.runtime._load(named)


class StreamingFakeSglangRuntime(FakeSglangRuntime):
    """The fake also standing in for SGLang's stream, abort and pause modes
    (:class:`rollout_engines_sglang.runtime.SglangStreamingRuntime`), in the formats SGLang's own
    source gives them (read in sgl-project/sglang, python/sglang/srt/managers/tokenizer_manager.py
    and io_struct.py):

    * chunks of ``async_generate(stream=True)`` for a batch: ``{"text", "output_ids", "meta_info",
      "index"}``; without ``incremental_streaming_output`` (SGLang's default) ``output_ids`` and the
      ``meta_info`` logprob lists hold everything so far, ``text`` is None until the last chunk;
      ``meta_info`` has ``id`` (the rid) and ``finish_reason`` (None, or a dict with ``type``:
      'length', 'stop', 'abort');
    * ``output_token_logprobs``: (logprob, token_id, text) per token; ``output_top_logprobs``: a
      list of those per token; ``input_token_logprobs`` (first logprob None) and
      ``input_top_logprobs`` (first None: scheduler_output_processor_mixin.py prepends it when
      ``logprob_start_len == 0``);
    * ``abort_request(rid)``: the request ends with ``finish_reason={'type': 'abort', ...}`` and its
      tokens so far; unknown rids are ignored;
    * ``pause_generation(mode)``: 'abort' aborts every request (and holds new ones), 'retract' and
      'in_place' stop the scheduler until ``continue_generation``.

    One token per sequence per step (``step_s`` apart), made from the weights current at that step.
    ``late_delivery``: each chunk arrives one step after it was made, and the chunks made before a
    pause arrive only at :meth:`release_late` (or at resume): SGLang answers a pause to the
    tokenizer manager directly while outputs go through the detokenizer, so outputs made before
    the pause can arrive after it (and after a push); this makes that order certain.
    """

    def __init__(self, *a: Any, incremental: bool = False, step_s: float = 0.002, **k: Any) -> None:
        super().__init__(*a, **k)
        self.incremental_stream = incremental
        self.step_s = step_s
        self.live: set[str] = set()
        self.aborting: set[str] = set()
        self.aborts: list[str | None] = []
        self.pause_modes: list[str] = []
        self._running = asyncio.Event()
        self._running.set()
        self._admit = asyncio.Event()
        self._admit.set()
        self.late_delivery = False
        self._caught_up = asyncio.Event()  # cleared by a pause (late_delivery); set by release_late or resume
        self._caught_up.set()

    async def generate_stream(self, *, input_ids: list[list[int]], sampling_params: list[dict], rid: list[str],
                              **kw: Any) -> AsyncIterator[dict[str, Any]]:
        if self.released:
            raise RuntimeError(f"memory released ({sorted(self.released)}): SGLang would crash or read garbage")
        if self.hang:
            await asyncio.Event().wait()
        await self._admit.wait()  # SGLang's tokenizer manager holds new requests while paused
        self.generate_calls.append({"input_ids": input_ids, "sampling_params": sampling_params, "rid": rid, **kw})
        loras = kw.get("lora_path") or [None] * len(rid)
        shifts = [self.lora_shift(n) for n in loras]
        self.lora_users.update({r: n for r, n in zip(rid, loras, strict=True) if n is not None})
        self.live |= set(rid)
        outs: dict[str, list[int]] = {r: [] for r in rid}
        done: set[str] = set()
        k_top = int(kw.get("top_logprobs_num") or 0)
        pending: dict[str, dict[str, Any]] = {}  # late_delivery: made, not yet delivered
        try:
            while len(done) < len(rid):
                await asyncio.sleep(self.step_s)
                if pending and not self._running.is_set():
                    await self._caught_up.wait()
                    for chunk in list(pending.values()):
                        yield chunk
                    pending.clear()
                await self._running.wait()
                for i, (r, ids, sp) in enumerate(zip(rid, input_ids, sampling_params, strict=True)):
                    if r in done:
                        continue
                    out = outs[r]
                    finish: dict[str, Any] | None
                    start = len(out)
                    if r in self.aborting:
                        finish = {"type": "abort", "message": "Abort request", "status_code": None}
                    else:
                        token = (sum(ids) + self.fingerprint() + shifts[i] + i * (sp["temperature"] > 0)) % self.vocab_size
                        out.append(token)
                        finish = {"type": "length", "length": len(out)} if len(out) == sp["max_new_tokens"] else None
                    chunk = self._chunk(i, r, ids, out, start, finish, kw, k_top)
                    earlier = pending.pop(r, None)
                    if earlier is not None:
                        yield earlier
                    if self.late_delivery and finish is None:
                        pending[r] = chunk
                    else:
                        yield chunk
                    if finish is not None:
                        done.add(r)
        finally:
            self.live -= set(rid)
            self.aborting -= set(rid)
            for r in rid:
                self.lora_users.pop(r, None)

    def _chunk(self, i: int, rid: str, ids: list[int], out: list[int], start: int, finish: dict | None,
               kw: dict[str, Any], k_top: int) -> dict[str, Any]:
        v = self.vocab_size
        assert v is not None
        lo = start if self.incremental_stream else 0
        meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids),
                                "weight_version": "default", "completion_tokens": len(out), "cached_tokens": 0}
        if kw.get("return_logprob"):
            meta["output_token_logprobs"] = [(-0.5, t, None) for t in out[lo:]]
            if k_top:
                # The sampled token is the second most likely here: with k=1 it is not among them.
                meta["output_top_logprobs"] = [
                    [(-0.25, (t + 1) % v, None), (-0.5, t, None), (-3.0, (t + 2) % v, None)][:k_top] for t in out[lo:]
                ]
            if kw.get("logprob_start_len") == 0 and (start == 0 or not self.incremental_stream):
                meta["input_token_logprobs"] = [(None, ids[0], None)] + [(-1.0, t, None) for t in ids[1:]]
                if k_top:
                    meta["input_top_logprobs"] = [None] + [
                        [(-0.75, (t + 3) % v, None), (-1.0, t, None)][:k_top] for t in ids[1:]
                    ]
        text = self.tokenizer.decode(out[lo:]) if (finish is not None or self.incremental_stream) else None
        return {"text": text, "output_ids": list(out[lo:]), "meta_info": meta, "index": i}

    async def abort(self, rid: str | None) -> None:
        self.aborts.append(rid)
        if rid is None:
            self.aborting |= self.live
        elif rid in self.live:
            self.aborting.add(rid)

    async def pause(self) -> None:
        await self.pause_mode("in_place")

    async def pause_mode(self, mode: str) -> None:
        self.pause_modes.append(mode)
        self.paused = True
        self._admit.clear()
        if mode == "abort":
            self.aborting |= self.live
            while self.live:  # SGLang returns once no request runs
                await asyncio.sleep(self.step_s)
        else:
            self._running.clear()
            if self.late_delivery:
                self._caught_up.clear()

    def release_late(self) -> None:
        """Deliver the chunks made before the pause (``late_delivery``)."""
        self._caught_up.set()

    async def resume(self) -> None:
        self.paused = False
        self._caught_up.set()
        self._running.set()
        self._admit.set()


def fake_trainer_memory(monkeypatch: Any, views: dict[str, list[tuple[str, torch.Tensor]]],
                        threads: list[str] | None = None) -> None:
    """A FAKE for the plugin loader's CUDA-only steps of forwarded buckets (a CPU cannot open
    another process's CUDA memory): the probe passes, a forwarded bucket's name maps to the CPU
    tensors registered under it in ``views`` (the name of each thread that asked is appended to
    ``threads``), and the segment importer maps and unmaps nothing. The rest of the loader runs."""
    from rollout_engines_sglang import loader

    class NoImporter:
        def finish(self) -> None:
            pass

        def close(self) -> None:
            pass

    states: dict[int, Any] = {}

    def shared_views(model: Any, name: str) -> list[tuple[str, torch.Tensor]]:
        if threads is not None:
            threads.append(threading.current_thread().name)
        return views[name]

    monkeypatch.setattr(loader, "probe", lambda model, name: None)
    monkeypatch.setattr(loader, "shared_views", shared_views)
    monkeypatch.setattr(loader, "_state", lambda model: states.setdefault(id(model), loader._Forwarded(NoImporter())))
