"""The embedded `transformers` engine: what the conformance suite cannot see from outside.

Agreement with transformers' own ``generate``, the event loop left free, request merging, real
release of parameter storage on sleep, interrupted in-place updates, and the sampler's masks.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from rollout_engines import (
    EngineClosed,
    EngineConfig,
    GenerateRequest,
    InvalidRequest,
    SamplingParams,
    WeightsInvalidated,
    WeightSyncError,
    create_engine,
)
from rollout_engines.backends.transformers.engine import TransformersEngine
from rollout_engines.backends.transformers.sampling import RowParams, sample
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed
from rollout_engines.weights.manifest import specs_of
from rollout_engines.weights.session import connect_weight_sync

pytestmark = pytest.mark.transformers

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "Once", "import numpy as np\nx = np.zeros(3)"]


def greedy(max_tokens: int = 8, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


async def push(e: TransformersEngine, tensors, version: int, transport: str = "inproc", **kw) -> int:
    sync = await connect_weight_sync([e], transport, timeout_s=60, **kw)
    try:
        return await sync.push(tensors, version=version)
    finally:
        await sync.close()


def ids_of(outs) -> list[list[int]]:
    return [c.token_ids for c in outs]


async def test_greedy_and_logprobs_match_transformers_generate(
    engine: TransformersEngine, tiny_model: Path, request: pytest.FixtureRequest
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    outs = await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(16, logprobs=1)))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: extra threads only spin on a busy machine
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    for out, prompt in zip(outs, PROMPTS, strict=True):  # one prompt at a time: no padding on the reference side
        ids = tok(prompt, return_tensors="pt").input_ids
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             pad_token_id=tok.pad_token_id, output_logits=True, return_dict_in_generate=True)
        ref_tokens = ref.sequences[0, ids.shape[1]:].tolist()
        assert out.prompt_token_ids == ids[0].tolist()
        assert out.token_ids == ref_tokens
        ref_lp = torch.stack(ref.logits, 1)[0].float().log_softmax(-1).gather(-1, torch.tensor(ref_tokens)[:, None])[:, 0]
        assert out.logprobs == pytest.approx(ref_lp.tolist(), abs=1e-4)


async def test_generation_passes_the_cache_under_the_name_transformers_takes(engine: TransformersEngine) -> None:
    """transformers renamed the forward's ``past_key_values`` to ``cache`` (the old name warns, and
    goes in 5.40); the engine passes whichever name the model's forward declares, so it neither
    warns nor, on a release without the new name, hands a ``cache`` to ``**kwargs`` unused (the
    greedy test above fails if decoding runs without its cache)."""
    import warnings

    from rollout_engines.backends.transformers.generation import _cache_kwarg

    class Renamed:
        def forward(self, input_ids, cache=None, **kwargs): ...

    class Before:
        def forward(self, input_ids, past_key_values=None, **kwargs): ...

    assert _cache_kwarg(Renamed) == "cache" and _cache_kwarg(Before) == "past_key_values"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = await engine.generate(GenerateRequest(prompts=PROMPTS[:2], sampling=greedy(4)))
    assert [len(o.token_ids) for o in outs] == [4, 4]
    assert not [str(w.message) for w in caught if "past_key_values" in str(w.message)]


async def test_generation_does_not_block_the_event_loop(engine: TransformersEngine) -> None:
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.002)

    task = asyncio.create_task(ticker())
    start = time.perf_counter()
    # 256 tokens a row: long enough (a few hundred ms here) that a much quicker machine still ticks.
    outs = await engine.generate(GenerateRequest(prompts=PROMPTS * 4, sampling=greedy(256, ignore_eos=True)))
    seconds = time.perf_counter() - start
    done.set()
    await task
    assert len(outs) == 16 and all(len(c.token_ids) == 256 for c in outs)
    # The loop kept running while the worker thread generated (a blocked loop would tick ~once).
    assert ticks >= 5, f"only {ticks} ticks in {seconds:.2f} s of generation"


async def test_concurrent_requests_are_merged_and_unchanged_by_it(engine: TransformersEngine) -> None:
    requests = [
        GenerateRequest(prompts=PROMPTS[:2], sampling=greedy(8)),
        GenerateRequest(prompts=PROMPTS[1:3], sampling=SamplingParams(temperature=1.0, max_tokens=6, seed=5, n=2)),
        GenerateRequest(prompts=PROMPTS[3:], sampling=SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=7, seed=9)),
        GenerateRequest(prompts=PROMPTS[:1], sampling=SamplingParams(temperature=1.0, min_p=0.05, max_tokens=5, seed=1, logprobs=1)),
    ]
    alone = [await engine.generate(r) for r in requests]
    batches_before = engine.batches_run
    # Hold the worker so that all four queue up behind it and are merged into one batch.
    gate = threading.Event()
    blocker = asyncio.ensure_future(engine._call(gate.wait))
    together = asyncio.ensure_future(asyncio.gather(*(engine.generate(r) for r in requests)))
    await asyncio.sleep(0.05)
    gate.set()
    await blocker
    merged = await together
    assert engine.batches_run == batches_before + 1, "the queued requests should share one batch"
    for a, b in zip(alone, merged, strict=True):
        assert ids_of(a) == ids_of(b)
        assert [(c.prompt_index, c.sample_index, c.finish_reason, c.text) for c in a] == \
            [(c.prompt_index, c.sample_index, c.finish_reason, c.text) for c in b]
    assert merged[3][0].logprobs == pytest.approx(alone[3][0].logprobs, abs=1e-4)


async def test_seeded_sample_does_not_depend_on_batch(engine: TransformersEngine) -> None:
    s = SamplingParams(temperature=1.0, max_tokens=10, seed=42, n=2, ignore_eos=True)
    alone = await engine.generate(GenerateRequest(prompts=PROMPTS[2:3], sampling=s))
    in_batch = await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=s))
    assert ids_of(alone) == ids_of([c for c in in_batch if c.prompt_index == 2])
    assert alone[0].token_ids != alone[1].token_ids, "n samples of one seeded request must differ"


async def test_sleep_level_1_releases_parameter_storage(engine: TransformersEngine) -> None:
    before = await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(8)))
    snapshot = {n: p.detach().clone() for n, p in engine.hf_model.named_parameters()}
    await engine.sleep(level=1)
    for name, param in engine.hf_model.named_parameters():
        assert param.untyped_storage().nbytes() == 0, f"{name} still holds its storage while asleep"
    assert (await engine.info()).extra["weights"] == "offloaded"
    await engine.wake_up()
    for name, param in engine.hf_model.named_parameters():
        assert torch.equal(param, snapshot[name])
    # Tied embeddings stay tied across sleep.
    assert engine.hf_model.lm_head.weight is engine.hf_model.model.embed_tokens.weight
    after = await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(8)))
    assert ids_of(after) == ids_of(before)


async def test_sleep_level_2_discards_and_needs_a_complete_push(engine: TransformersEngine, tiny_model: Path) -> None:
    before = await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(8)))
    await engine.sleep(level=2)
    assert not engine._offloaded, "level 2 keeps no copy"
    assert all(p.numel() == 0 for p in engine.hf_model.parameters())
    await engine.wake_up()
    with pytest.raises(WeightsInvalidated):
        await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(2)))
    original = load_checkpoint(tiny_model)
    partial = {"model.norm.weight": original["model.norm.weight"]}
    with pytest.raises(WeightSyncError, match="complete push"):
        await push(engine, partial, 1)
    with pytest.raises(WeightsInvalidated):
        await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(2)))
    assert await push(engine, original, 2) == 2
    after = await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(8)))
    assert ids_of(after) == ids_of(before) and {c.weight_version for c in after} == {2}


@pytest.mark.parametrize("mode", ["staged", "inplace"])
async def test_update_interrupted_midway(tiny_model: Path, mode: str) -> None:
    engine = create_engine(EngineConfig(model=str(tiny_model), options={"weight_apply_mode": mode}))
    try:
        before = await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(8)))
        original = load_checkpoint(tiny_model)
        new = perturbed(original)
        items = list(new.items())

        def dies_halfway():
            for i, item in enumerate(items):
                if i == len(items) // 2:
                    raise RuntimeError("trainer lost a shard")
                yield item

        sync = await connect_weight_sync([engine], "inproc", timeout_s=60, bucket_bytes=64 * 1024)
        try:
            with pytest.raises(WeightSyncError) as failure:
                await sync.push(dies_halfway(), version=1, specs=specs_of(items))
            # The receiver learns of the abort at once; it does not wait for its timeout.
            assert "aborted" in str(failure.value) and "lost a shard" in str(failure.value)
            if mode == "staged":  # nothing was applied: same weights, same version
                after = await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(8)))
                assert ids_of(after) == ids_of(before) and engine.weight_version == 0
            else:  # some buckets landed: the engine refuses rather than serve a mix
                with pytest.raises(WeightsInvalidated):
                    await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(2)))
                assert (await engine.info()).healthy is False
            assert await sync.push(original, version=3) == 3
        finally:
            await sync.close()
        after = await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(8)))
        assert ids_of(after) == ids_of(before)
    finally:
        await engine.close()


async def test_context_window_holds_prompt_and_max_tokens(tiny_model: Path) -> None:
    """The one window rule of every backend: len(prompt) + max_tokens <= max_model_len."""
    engine = create_engine("transformers", model=str(tiny_model), max_model_len=12)
    try:
        out = (await engine.generate(GenerateRequest(prompt_token_ids=[list(range(10, 18))],
                                                      sampling=greedy(4, ignore_eos=True))))[0]
        assert len(out.token_ids) == 4 and out.finish_reason == "length"
        with pytest.raises(InvalidRequest, match=r"exceed the context window.*at most 4 here"):
            await engine.generate(GenerateRequest(prompt_token_ids=[list(range(10, 18))],
                                                  sampling=greedy(5, ignore_eos=True)))
        with pytest.raises(InvalidRequest, match="context window"):
            await engine.generate(GenerateRequest(prompt_token_ids=[list(range(10, 22))], sampling=greedy(1)))
        with pytest.raises(InvalidRequest, match="vocabulary"):
            await engine.generate(GenerateRequest(prompt_token_ids=[[5000]], sampling=greedy(1)))
    finally:
        await engine.close()


async def test_eos_from_generation_config_unless_ignored(tiny_model: Path, tmp_path: Path) -> None:
    first = create_engine("transformers", model=str(tiny_model))
    ref = (await first.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=greedy(8, ignore_eos=True))))[0]
    await first.close()
    # A copy of the model whose generation config names the third greedy token as an EOS.
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    gen = json.loads((model / "generation_config.json").read_text())
    eos = ref.token_ids[2]
    gen["eos_token_id"] = [*gen["eos_token_id"], eos]
    (model / "generation_config.json").write_text(json.dumps(gen))
    engine = create_engine("transformers", model=str(model))
    try:
        out = (await engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=greedy(8))))[0]
        cut = ref.token_ids.index(eos) + 1
        assert out.token_ids == ref.token_ids[:cut] and out.finish_reason == "stop"
        assert out.text == engine.tokenizer.decode(ref.token_ids[: cut - 1], skip_special_tokens=True)
        kept = (await engine.generate(GenerateRequest(prompts=PROMPTS[:1], sampling=greedy(8, ignore_eos=True))))[0]
        assert kept.token_ids == ref.token_ids and kept.finish_reason == "length"
    finally:
        await engine.close()


async def test_close_fails_queued_requests_and_streams_and_frees_the_model(engine: TransformersEngine) -> None:
    gate = threading.Event()
    blocker = asyncio.ensure_future(engine._call(gate.wait))  # holds the worker: requests stay queued
    queued = asyncio.ensure_future(engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(4))))

    async def consume() -> list[object]:
        return [d async for d in engine.stream(GenerateRequest(prompts=PROMPTS[:1], sampling=greedy(4)))]

    streamed = asyncio.ensure_future(consume())
    deadline = time.monotonic() + 30
    while len(engine._ids) < len(PROMPTS) + 1:  # both queued
        assert time.monotonic() < deadline, "the requests were never queued"
        await asyncio.sleep(0.005)
    closing = asyncio.ensure_future(engine.close())
    await asyncio.sleep(0.05)
    gate.set()
    await closing
    await blocker
    with pytest.raises(EngineClosed):
        await queued
    with pytest.raises(EngineClosed):
        await asyncio.wait_for(streamed, 5)  # woken, not left waiting for rows that never come
    assert engine.hf_model is None and not engine._worker.is_alive()


def test_capabilities_on_cpu(tiny_model: Path) -> None:
    engine = create_engine("transformers", model=str(tiny_model), device="cpu")
    asyncio.run(engine.close())
    caps = engine.capabilities
    assert {"inproc", "gloo", "shm", "disk"} <= set(caps.transports)
    assert not {"nccl", "cuda_ipc"} & set(caps.transports)
    assert caps.sleep_levels == (1, 2) and set(caps.sleep_tags) == {"weights", "kv_cache"}
    assert caps.pause and not caps.prefix_cache and not caps.multi_process


@pytest.mark.parametrize("dtype", ["bfloat16", "auto"])
async def test_dtype_from_config(tiny_model: Path, dtype: str) -> None:
    engine = create_engine("transformers", model=str(tiny_model), dtype=dtype)
    try:
        expected = torch.bfloat16 if dtype == "bfloat16" else torch.float32  # auto: the checkpoint's
        assert {p.dtype for p in engine.hf_model.parameters()} == {expected}
        out = await engine.generate(GenerateRequest(prompts=PROMPTS[:2], sampling=greedy(4, ignore_eos=True)))
        assert [len(c.token_ids) for c in out] == [4, 4]
    finally:
        await engine.close()


# ---- the sampler ------------------------------------------------------------------------------
def _params(rows: int, **kw: float) -> RowParams:
    def col(name: str, default: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows,), kw.get(name, default), dtype=dtype)

    return RowParams(col("temperature", 1.0), col("top_p", 1.0), col("top_k", 8, torch.long), col("min_p", 0.0))


def _draws(logits: torch.Tensor, params: RowParams, n: int = 400) -> set[int]:
    shared = torch.Generator().manual_seed(0)
    seen: set[int] = set()
    for _ in range(n):
        tokens, _ = sample(logits[None], params, [None], shared)
        seen.add(int(tokens[0]))
    return seen


def test_sampler_masks() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0])
    probs = logits.softmax(-1)
    assert _draws(logits, _params(1, top_k=2)) == {0, 1}
    # top_p keeps the smallest set reaching p: here tokens 0 and 1 (0.64 + 0.23 >= 0.8).
    assert probs[0] < 0.8 <= probs[:2].sum()
    assert _draws(logits, _params(1, top_p=0.8)) == {0, 1}
    # min_p keeps tokens with at least min_p * max prob: e^-1 > 0.3 > e^-2.
    assert _draws(logits, _params(1, min_p=0.3)) == {0, 1}
    assert _draws(logits, _params(1)) >= {0, 1, 2, 3}
    greedy_tok, lp = sample(logits[None], _params(1, temperature=0.0), [None], torch.Generator())
    assert int(greedy_tok[0]) == 0 and float(lp[0]) == pytest.approx(float(probs.log()[0]), abs=1e-6)


def test_sampler_logprobs_ignore_temperature_and_masks() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = RowParams(torch.tensor([0.5, 1.5, 2.0]), torch.tensor([0.9, 0.5, 1.0]),
                       torch.tensor([5, 50, 3]), torch.tensor([0.0, 0.1, 0.0]))
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    tokens, logprobs = sample(logits, params, gens, torch.Generator())
    raw = logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(logprobs, raw)
    # Same generators, same draws: a seeded row is reproducible.
    again, _ = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(3)], torch.Generator())
    assert torch.equal(tokens, again)


@pytest.mark.gpu
async def test_cuda_sleep_returns_gpu_memory(tiny_model: Path) -> None:
    engine = create_engine("transformers", model=str(tiny_model), device="cuda")
    try:
        assert {"nccl", "cuda_ipc", "inproc", "gloo", "shm", "disk"} <= set(engine.capabilities.transports)
        before = await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(8, ignore_eos=True)))
        weights = sum(p.numel() * p.element_size() for p in engine.hf_model.parameters())
        torch.cuda.synchronize()
        awake = torch.cuda.memory_allocated()
        await engine.sleep(level=1)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= awake - 0.9 * weights
        await engine.wake_up()
        assert all(p.device.type == "cuda" for p in engine.hf_model.parameters())
        after = await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(8, ignore_eos=True)))
        assert ids_of(after) == ids_of(before)
        # Pushes through files (disk) and in-process (inproc) land in the GPU parameters.
        original = load_checkpoint(tiny_model)
        await push(engine, perturbed(original), 1, transport="disk")
        changed = await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(8, ignore_eos=True)))
        assert ids_of(changed) != ids_of(before)
        await push(engine, original, 2)
        assert all(p.device.type == "cuda" for p in engine.hf_model.parameters())
        restored = await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=greedy(8, ignore_eos=True)))
        assert ids_of(restored) == ids_of(before)
    finally:
        await engine.close()


async def test_request_larger_than_a_batch_runs_in_slices(tiny_model: Path) -> None:
    engine = create_engine("transformers", model=str(tiny_model), max_batch_rows=3)
    try:
        s = SamplingParams(temperature=1.0, max_tokens=5, seed=3, n=2, ignore_eos=True)
        sliced = await engine.generate(GenerateRequest(prompts=PROMPTS, sampling=s))
        assert [(c.prompt_index, c.sample_index) for c in sliced] == [(i, j) for i in range(4) for j in range(2)]
    finally:
        await engine.close()
    whole = create_engine("transformers", model=str(tiny_model))
    try:
        assert ids_of(await whole.generate(GenerateRequest(prompts=PROMPTS, sampling=s))) == ids_of(sliced)
    finally:
        await whole.close()
