"""SglangEngine's own logic over FakeSglangRuntime (SGLang needs CUDA; see the fake's docstring):
sleep that releases weights is enforced by the core (WeightsInvalidated until a push), relayed and
disk pushes reach SGLang as real payloads, and partial failures make the engine refuse to generate."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_engines.errors import (
    CapabilityError,
    EngineAsleep,
    InvalidRequest,
    WeightsInvalidated,
    WeightSyncError,
)
from rollout_engines.types import (
    Completion,
    EngineConfig,
    GenerateRequest,
    SamplingParams,
    StreamDelta,
    TokenLogprob,
)
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed
from rollout_engines.weights.session import connect_weight_sync
from rollout_engines_sglang import loader
from rollout_engines_sglang.engine import SglangEngine
from rollout_engines_sglang.loader import LOADER, planned_loader
from sglang_fake import FakeSglangRuntime, StreamingFakeSglangRuntime

GREEDY = GenerateRequest(prompt_token_ids=[[5, 6, 7], [9]], sampling=SamplingParams(temperature=0.0, max_tokens=4))


def make(tiny_model, *, tp_size: int = 1, streaming: bool = True, incremental: bool = False,
         weight_loaders: tuple[str, ...] = (), **options) -> tuple[SglangEngine, StreamingFakeSglangRuntime]:
    backup = options.get("enable_weights_cpu_backup", False)
    if streaming:
        fake = StreamingFakeSglangRuntime(tiny_model, tp_size=tp_size, cpu_backup=backup, incremental=incremental,
                                          weight_loaders=weight_loaders)
    else:
        fake = FakeSglangRuntime(tiny_model, tp_size=tp_size, cpu_backup=backup,  # type: ignore[assignment]
                                 weight_loaders=weight_loaders)
    config = EngineConfig(
        backend="sglang", model=str(tiny_model), dtype="float32", tensor_parallel_size=tp_size,
        options={"relay_device": "cpu", **options},
    )
    return SglangEngine(config, runtime=fake), fake


def checkpoint(tiny_model) -> dict[str, torch.Tensor]:
    return load_checkpoint(tiny_model, dtype=torch.float32)


async def push(engine: SglangEngine, tensors: dict[str, torch.Tensor], version: int, transport: str = "inproc",
               **kw) -> int:
    sync = await connect_weight_sync([engine], transport, **kw)
    try:
        return await sync.push(tensors, version=version)
    finally:
        await sync.close()


def test_declared_capabilities(tiny_model) -> None:
    engine, _ = make(tiny_model)
    caps = engine.capabilities
    assert caps.weights_kept_on_sleep is False and caps.sleep_levels == (1,)
    assert set(caps.sleep_tags) == {"weights", "kv_cache"}
    assert {"sglang_nccl", "cuda_ipc", "disk"} <= set(caps.transports)
    assert caps.seed is False and caps.tensor_parallel
    backed, _ = make(tiny_model, enable_weights_cpu_backup=True, enable_deterministic_inference=True)
    assert backed.capabilities.weights_kept_on_sleep is True and backed.capabilities.seed is True
    assert engine.weight_receivers() == 1


async def test_sleeping_weights_refuses_generation_until_a_push(tiny_model) -> None:
    engine, fake = make(tiny_model)
    before = await engine.generate(GREEDY)
    await engine.sleep()
    assert fake.released == {"weights", "kv_cache"}
    with pytest.raises(EngineAsleep):
        await engine.generate(GREEDY)
    await engine.wake_up()
    assert fake.released == set()
    # SGLang gave the memory back without the values: generating now would be garbage ...
    assert fake.fingerprint() != before[0].token_ids[0] - sum(GREEDY.prompt_token_ids[0])
    calls = len(fake.generate_calls)
    with pytest.raises(WeightsInvalidated, match="Push a complete set of weights"):
        await engine.generate(GREEDY)
    assert len(fake.generate_calls) == calls  # ... and the core refused before reaching SGLang
    assert (await engine.info()).healthy is False
    assert await push(engine, checkpoint(tiny_model), version=3) == 3
    after = await engine.generate(GREEDY)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
    assert all(c.weight_version == 3 for c in after) and (await engine.info()).healthy


async def test_sleeping_only_the_kv_cache_keeps_weights(tiny_model) -> None:
    engine, fake = make(tiny_model)
    before = await engine.generate(GREEDY)
    flushes = fake.flushes
    await engine.sleep(tags=["kv_cache"])
    await engine.wake_up()
    assert fake.flushes == flushes + 1  # the prefix cache is reset after waking
    assert [c.token_ids for c in await engine.generate(GREEDY)] == [c.token_ids for c in before]


async def test_the_relays_staging_buffer_stays_between_pushes_and_goes_with_sleep(tiny_model) -> None:
    engine, fake = make(tiny_model)
    new = perturbed(checkpoint(tiny_model), seed=13)
    sync = await connect_weight_sync([engine], "inproc")
    try:
        await sync.push(new, version=1)
        target = engine._transfer.receiver.target
        kept = target._stager
        assert kept is not None  # kept for the next push of the same layout
        await sync.push(checkpoint(tiny_model), version=2)
        assert target._stager is kept
        extra = (await engine.info()).extra  # staged (inproc buckets are not the trainer's GPU memory)
        assert extra["relay_forwarded_buckets"] == 0 and extra["relay_staging_bytes"] >= sum(
            t.numel() * t.element_size() for t in new.values())
        await engine.sleep()  # a colocated trainer wants that memory back
        assert target._stager is None and (await engine.info()).extra["relay_staging_bytes"] == 0
        await engine.wake_up()
        await sync.push(new, version=3)
        assert all(torch.equal(fake.weights[n], t) for n, t in new.items())
    finally:
        await sync.close()


async def test_cpu_backup_keeps_weights_over_sleep(tiny_model) -> None:
    engine, _ = make(tiny_model, enable_weights_cpu_backup=True)
    before = await engine.generate(GREEDY)
    await engine.sleep()
    await engine.wake_up()
    assert [c.token_ids for c in await engine.generate(GREEDY)] == [c.token_ids for c in before]


async def test_relayed_push_reaches_every_tp_rank(tiny_model) -> None:
    engine, fake = make(tiny_model, tp_size=2)
    new = perturbed(checkpoint(tiny_model), seed=5)
    flushes = fake.flushes
    assert await push(engine, new, version=1, bucket_bytes=64 * 1024) == 1
    assert len(fake.tensor_updates) > 1 and set(fake.tensor_updates) == {2}  # one payload per rank
    for name, t in new.items():
        assert torch.equal(fake.weights[name], t), name
    assert fake.flushes == flushes + 1 and engine.weight_version == 1
    comps = await engine.generate(GREEDY)
    assert comps[0].weight_version == 1


async def test_the_loader_lets_go_of_the_staging_buffer_before_the_relay_frees_it(tiny_model) -> None:
    """Each rank's loader keeps its import of the relay's staging buffer between pushes (one entry
    per layout); when the engine sleeps, the relay first tells every rank to let go (a kept import
    would hold the memory the trainer wants back), and pushes after waking work as before."""
    engine, fake = make(tiny_model, tp_size=2, weight_loaders=(LOADER,), copy_plan=True)
    new = perturbed(checkpoint(tiny_model), seed=14)
    sync = await connect_weight_sync([engine], "inproc")
    try:
        for version in (1, 2):
            await sync.push(new, version=version)
            assert all(len(loader._kept[m]) == 1 for m in fake.models)
        await engine.sleep()
        assert all(m not in loader._kept and not planned_loader(m).plan._views for m in fake.models)
        await engine.wake_up()
        await sync.push(checkpoint(tiny_model), version=3)
        assert all(torch.equal(fake.weights[n], t) for n, t in checkpoint(tiny_model).items())
        assert all(len(loader._kept[m]) == 1 for m in fake.models)
    finally:
        await sync.close()
    assert all(m not in loader._kept for m in fake.models)  # closing the transfer lets go too


async def test_a_failed_let_go_still_frees_the_staging_buffer_and_sleeps(tiny_model, caplog) -> None:
    engine, fake = make(tiny_model, weight_loaders=(LOADER,), copy_plan=True)
    sync = await connect_weight_sync([engine], "inproc")
    try:
        await sync.push(perturbed(checkpoint(tiny_model), seed=15), version=1)
        fake.fail_update_at = fake._updates + 1  # SGLang answers the let-go call with a failure
        target = engine._transfer.receiver.target
        with caplog.at_level("WARNING", logger="rollout_engines.sglang"):
            await engine.sleep()
        assert target._stager is None and "did not let go" in caplog.text
        await engine.wake_up()
        await sync.push(checkpoint(tiny_model), version=2)  # the next push works
        assert all(torch.equal(fake.weights[n], t) for n, t in checkpoint(tiny_model).items())
    finally:
        await sync.close()


async def test_relayed_pushes_go_through_the_copy_plan_loader(tiny_model) -> None:
    """A runtime started with the plugin's loader gets every relayed bucket in the loader's form;
    each rank's model records on the first push and replays on the next (load_weights then sees
    only the names the plan cannot replay)."""
    engine, fake = make(tiny_model, tp_size=2, weight_loaders=(LOADER,), copy_plan=True)
    first = perturbed(checkpoint(tiny_model), seed=5)
    assert await push(engine, first, version=1, bucket_bytes=64 * 1024) == 1
    assert len(fake.load_formats) > 1 and set(fake.load_formats) == {LOADER}
    assert all(torch.equal(fake.weights[n], t) for n, t in first.items())
    recorded = {n for model in fake.models for call in model.load_calls for n in call}
    assert recorded == set(first)

    for model in fake.models:
        model.load_calls.clear()
    second = perturbed(checkpoint(tiny_model), seed=6)
    assert await push(engine, second, version=2, bucket_bytes=64 * 1024) == 2
    for name, t in second.items():
        assert torch.equal(fake.weights[name], t), name
    for model in fake.models:
        fallback = planned_loader(model).plan.fallback
        assert {n for call in model.load_calls for n in call} == fallback
        assert len(fallback) < len(second) // 2  # the rest was copied
    assert (await engine.generate(GREEDY))[0].weight_version == 2
    last = (await engine.diagnostics()).last_receive  # what `bench push` reports as worker phases
    assert last is not None and last.version == 2 and last.workers[0].apply_s > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback where no GPU can be read")
@pytest.mark.parametrize("forward", [True, False])
async def test_a_relay_forwards_only_when_asked_and_its_loader_can_read_the_trainers_memory(tiny_model, forward) -> None:
    """A bucket of the trainer's own tensors (what ``cuda_ipc`` shares without packing) is forwarded
    only with option ``forward_buckets`` and once SGLang's loader said it can open the trainer's
    memory. Here it cannot (no CUDA): the relay declines, so the receiver stages the bucket as
    before, and it does not ask again. Without the option it never asks."""
    from rollout_engines.weights.manifest import plan_manifest, specs_of
    from rollout_engines.weights.transports.cuda_ipc import SharedViews

    engine, fake = make(tiny_model, weight_loaders=(LOADER,), copy_plan=True, forward_buckets=forward)
    sync = await connect_weight_sync([engine], "inproc")
    try:
        await sync.push(checkpoint(tiny_model), version=1)
        target = engine._transfer.receiver.target
        named = checkpoint(tiny_model)
        placements = plan_manifest(specs_of(list(named.items())), version=2).bucket_tensors(0)
        shared = SharedViews([named[p.name] for p in placements], '{"segments":[],"refs":[]}', "GPU-1")
        calls = len(fake.load_formats)
        for _ in range(2):
            assert await asyncio.to_thread(target.apply_shared, 0, placements, shared) is False
        assert len(fake.load_formats) == calls + forward  # with the option: one probe, refused
        assert target.forwarded == 0 and target._forwards is (False if forward else None)
    finally:
        await sync.close()


async def test_a_relayed_bucket_sglang_never_loads_fails_within_the_transfers_timeout(tiny_model) -> None:
    """Every wait is bounded: SGLang not answering an update (a hung scheduler: faked here, a real
    one cannot be made to hang on cue) fails the push after the weight transfer's timeout_s."""
    engine, fake = make(tiny_model, weight_loaders=(LOADER,), copy_plan=True)

    async def hang(payloads, load_format="flattened_bucket"):
        await asyncio.sleep(3600)

    fake.update_from_tensor = hang
    sync = await connect_weight_sync([engine], "inproc", timeout_s=1)
    try:
        with pytest.raises(WeightSyncError, match="did not load a relayed bucket within 1 s"):
            await asyncio.wait_for(sync.push(checkpoint(tiny_model), version=1), 30)
    finally:
        await sync.close()


async def test_copy_plan_is_the_default_off_or_loader_missing_keeps_sglangs_flattened_bucket(tiny_model) -> None:
    off, fake_off = make(tiny_model, weight_loaders=(LOADER,), copy_plan=False)
    missing, fake_missing = make(tiny_model, copy_plan=True)  # a runtime not started with the loader
    default, fake_default = make(tiny_model, weight_loaders=(LOADER,))  # on by default
    new = perturbed(checkpoint(tiny_model), seed=5)
    for engine, fake in ((off, fake_off), (missing, fake_missing)):
        assert await push(engine, new, version=1) == 1
        assert set(fake.load_formats) == {"flattened_bucket"}
        assert all(torch.equal(fake.weights[n], t) for n, t in new.items())
    assert await push(default, new, version=1) == 1
    assert set(fake_default.load_formats) == {LOADER}
    assert all(torch.equal(fake_default.weights[n], t) for n, t in new.items())


async def test_rejected_manifest_changes_nothing(tiny_model) -> None:
    engine, fake = make(tiny_model)
    bad = checkpoint(tiny_model)
    bad["model.norm.weight"] = torch.ones(3)
    bad["model.not_a_weight"] = torch.ones(2)
    before = {n: t.clone() for n, t in fake.weights.items()}
    with pytest.raises(WeightSyncError, match="rejected before applying anything"):
        await push(engine, bad, version=1)
    assert fake.tensor_updates == []
    assert all(torch.equal(fake.weights[n], t) for n, t in before.items())
    await engine.generate(GREEDY)  # still serving the old weights
    assert engine.weight_version == 0


async def test_update_failing_midway_refuses_generation_until_a_complete_push(tiny_model) -> None:
    engine, fake = make(tiny_model)
    fake.fail_update_at = 2
    new = perturbed(checkpoint(tiny_model), seed=9)
    # timeout_s: the trainer's sender notices the engine stopped reading after this long.
    with pytest.raises(WeightSyncError, match="injected fault") as info:
        await push(engine, new, version=1, bucket_bytes=64 * 1024, timeout_s=3)
    ((_, engine_error),) = info.value.failures
    assert isinstance(engine_error, WeightsInvalidated)
    with pytest.raises(WeightsInvalidated):
        await engine.generate(GREEDY)
    assert engine.weight_version == 0
    fake.fail_update_at = None
    await push(engine, new, version=2, bucket_bytes=64 * 1024)
    assert all(torch.equal(fake.weights[n], t) for n, t in new.items())
    assert (await engine.generate(GREEDY))[0].weight_version == 2


async def test_disk_push_loads_the_update_directory(tiny_model, tmp_path) -> None:
    engine, fake = make(tiny_model)
    new = perturbed(checkpoint(tiny_model), seed=11)
    await push(engine, new, version=4, transport="disk", bucket_bytes=128 * 1024, options={"path": str(tmp_path)})
    (path,) = fake.disk_updates
    assert path.startswith(str(tmp_path)) and "v00000004" in path
    assert all(torch.equal(fake.weights[n], t) for n, t in new.items())
    assert (await engine.generate(GREEDY))[0].weight_version == 4
    fake.fail_disk = True
    with pytest.raises(WeightSyncError):
        await push(engine, perturbed(new, seed=12), version=5, transport="disk", options={"path": str(tmp_path)})
    with pytest.raises(WeightsInvalidated):
        await engine.generate(GREEDY)


async def test_request_features_and_controls(tiny_model) -> None:
    engine, fake = make(tiny_model)
    req = GenerateRequest(
        prompts=["hello", "world"], sampling=SamplingParams(n=2, logprobs=0, max_tokens=3, stop=["x"], temperature=0.8)
    )
    comps = await engine.generate(req)
    assert [(c.prompt_index, c.sample_index) for c in comps] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(c.logprobs == [-0.5] * 3 and len(c.token_ids) == 3 for c in comps)
    sent = fake.generate_calls[-1]
    assert len(sent["input_ids"]) == 4 and sent["return_logprob"] is True
    assert sent["sampling_params"][0]["stop"] == ["x"]
    assert comps[0].prompt_token_ids == fake.tokenizer.encode("hello")
    chat = await engine.chat(GenerateRequest(messages=[[{"role": "user", "content": "hi"}]]))
    assert len(chat) == 1 and chat[0].prompt_token_ids[-1] != fake.tokenizer.encode("hi")[-1]
    with pytest.raises(CapabilityError, match="enable_deterministic_inference"):
        await engine.generate(GenerateRequest(prompt_token_ids=[[1]], sampling=SamplingParams(seed=3)))
    await engine.pause()
    assert fake.paused and (await engine.info()).paused
    await engine.resume()
    assert not fake.paused
    flushes = fake.flushes
    await engine.reset_prefix_cache()
    assert fake.flushes == flushes + 1
    await engine.close()
    assert fake.shut_down


async def test_prompts_that_sglang_cannot_take_are_refused_before_it(tiny_model) -> None:
    """The core's prompt rules, with SGLang's context length (the fake's: 256) and vocabulary:
    prompt + max_tokens may fill the window exactly, one token more is refused, as are token ids
    outside the vocabulary and empty prompts; nothing refused reaches SGLang."""
    engine, fake = make(tiny_model)
    try:
        fits = GenerateRequest(prompt_token_ids=[[5] * 250], sampling=SamplingParams(temperature=0.0, max_tokens=6))
        assert len((await engine.generate(fits))[0].token_ids) == 6
        calls = len(fake.generate_calls)
        too_long = GenerateRequest(prompt_token_ids=[[5] * 251], sampling=SamplingParams(temperature=0.0, max_tokens=6))
        with pytest.raises(InvalidRequest, match="exceed the context window of 256"):
            await engine.generate(too_long)
        with pytest.raises(InvalidRequest, match="outside the model's vocabulary"):
            await engine.generate(GenerateRequest(prompt_token_ids=[[1, fake.vocab_size]]))
        with pytest.raises(InvalidRequest, match="no tokens"):
            await engine.generate(GenerateRequest(prompts=[""]))
        assert len(fake.generate_calls) == calls
    finally:
        await engine.close()


async def test_requests_in_flight_on_a_failed_worker_get_a_clear_error_not_a_hang(tiny_model) -> None:
    """A scheduler that dies mid-request never answers it (seen on a GPU: the first float32 request
    crashed SGLang's scheduler). Once the worker's SIGQUIT arrives, waiting requests fail fast."""
    import asyncio
    import time

    from rollout_engines.errors import EngineUnavailable

    engine, fake = make(tiny_model)
    try:
        fake.hang = True
        waiting = asyncio.ensure_future(engine.generate(GREEDY))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        start = time.monotonic()
        engine._on_worker_failure()  # what the SIGQUIT guard calls
        with pytest.raises(EngineUnavailable, match="worker process failed"):
            await asyncio.wait_for(waiting, timeout=5)
        assert time.monotonic() - start < 2
        with pytest.raises(EngineUnavailable):
            await engine.generate(GREEDY)
        assert not await engine.health()
    finally:
        await engine.close()


async def test_a_push_flushes_the_prefix_cache_only_after_generation(tiny_model) -> None:
    """Nothing generated since the last flush means nothing cached with the old weights: SGLang's
    flush (which also empties torch's allocator cache) is skipped, as in the vLLM plugin."""
    engine, fake = make(tiny_model)
    new, orig = perturbed(checkpoint(tiny_model), seed=5), checkpoint(tiny_model)
    await engine.generate(GREEDY)
    flushes = fake.flushes
    await push(engine, new, version=1)
    assert fake.flushes == flushes + 1
    await push(engine, orig, version=2)  # nothing generated in between
    assert fake.flushes == flushes + 1
    await engine.generate(GREEDY)
    await push(engine, new, version=3)
    assert fake.flushes == flushes + 2
    await engine.sleep(tags=["kv_cache"])
    await engine.wake_up()  # memory came back: flushed whatever was generated before
    assert fake.flushes == flushes + 3
    await engine.close()


# ---- async RL: request ids, streaming, abort, pause modes, logprobs, continuation ------------------
def test_async_rl_capabilities_follow_the_runtime(tiny_model) -> None:
    engine, _ = make(tiny_model)
    caps = engine.capabilities
    assert caps.streaming and caps.abort and caps.prompt_logprobs and caps.continuation
    assert set(caps.pause_modes) == {"wait", "abort", "keep"} and caps.top_logprobs == 20
    # A runtime without SGLang's stream / abort / pause modes (e.g. the remote HTTP one): none declared.
    plain, _ = make(tiny_model, streaming=False)
    pc = plain.capabilities
    assert not (pc.streaming or pc.abort or pc.prompt_logprobs or pc.continuation or pc.top_logprobs)
    assert pc.pause_modes == () and plain.pause_modes() == ("wait",)


async def test_request_ids_are_sglang_rids(tiny_model) -> None:
    engine, fake = make(tiny_model)
    req = GenerateRequest(prompt_token_ids=[[5, 6], [7]], sampling=SamplingParams(n=2, max_tokens=2, temperature=0.5),
                          request_ids=["a", "b", "c", "d"])
    outs = await engine.generate(req)
    assert fake.generate_calls[-1]["rid"] == ["a", "b", "c", "d"]
    assert [c.request_id for c in outs] == ["a", "b", "c", "d"]
    auto = await engine.generate(GREEDY)
    assert [c.request_id for c in auto] == fake.generate_calls[-1]["rid"] and all(auto[i].request_id for i in (0, 1))


@pytest.mark.parametrize("incremental", [False, True])
async def test_stream_deltas_add_up_to_generate(tiny_model, incremental) -> None:
    engine, fake = make(tiny_model, incremental=incremental)
    s = SamplingParams(temperature=0.0, max_tokens=5, logprobs=0, top_logprobs=2)
    req = GenerateRequest(prompt_token_ids=[[5, 6, 7], [9]], sampling=s, request_ids=["x", "y"])
    whole = {c.request_id: c for c in await engine.generate(req)}
    got: dict[str, list] = {"x": [], "y": []}
    finish: dict[str, str] = {}
    deltas = []
    async for d in engine.stream(req):
        assert d.request_id not in finish
        deltas.append(d)
        got[d.request_id].extend(d.token_ids)
        assert d.logprobs == [-0.5] * len(d.token_ids) and d.weight_version == 0
        assert d.top_logprobs is not None and len(d.top_logprobs) == len(d.token_ids)
        if d.finish_reason:
            finish[d.request_id] = d.finish_reason
    assert len(deltas) >= 10  # one chunk per token: the stream is SGLang's, not the finished output
    assert {r: c.token_ids for r, c in whole.items()} == got and finish == {"x": "length", "y": "length"}
    for c in whole.values():
        assert c.top_logprobs == [
            [TokenLogprob(token_id=(t + 1) % fake.vocab_size, logprob=-0.25), TokenLogprob(token_id=t, logprob=-0.5)]
            for t in c.token_ids
        ]
        assert c.text == fake.tokenizer.decode(c.token_ids)
    # A consumer that stops early aborts what is still running in SGLang.
    long = GenerateRequest(prompt_token_ids=[[3]], sampling=SamplingParams(max_tokens=250), request_ids=["early"])
    stream = engine.stream(long)
    await stream.__anext__()
    await stream.aclose()
    assert "early" in fake.aborts


async def test_top_logprobs_add_the_sampled_token_and_prompt_logprobs(tiny_model) -> None:
    engine, fake = make(tiny_model)
    s = SamplingParams(temperature=0.0, max_tokens=3, top_logprobs=1, prompt_logprobs=1)
    [c] = await engine.generate(GenerateRequest(prompt_token_ids=[[5, 6, 7]], sampling=s))
    sent = fake.generate_calls[-1]
    assert sent["return_logprob"] is True and sent["logprob_start_len"] == 0 and sent["top_logprobs_num"] == 1
    assert c.logprobs is None  # not asked for
    for t, top in zip(c.token_ids, c.top_logprobs, strict=True):  # k=1 plus the sampled token, sorted
        assert [x.token_id for x in top] == [(t + 1) % fake.vocab_size, t]
    assert c.prompt_logprobs == [None, -1.0, -1.0]
    assert c.prompt_top_logprobs == [[]] + [[TokenLogprob(token_id=(t + 3) % fake.vocab_size, logprob=-0.75)]
                                            for t in (6, 7)]
    # No prompt logprobs asked: SGLang computes none (logprob_start_len=-1).
    await engine.generate(GenerateRequest(prompt_token_ids=[[5]], sampling=SamplingParams(max_tokens=1, top_logprobs=0)))
    assert fake.generate_calls[-1]["logprob_start_len"] == -1


async def test_abort_by_id_and_all_return_partial_tokens(tiny_model) -> None:
    import asyncio

    engine, fake = make(tiny_model)
    long = SamplingParams(temperature=0.0, max_tokens=250)
    task = asyncio.ensure_future(engine.generate(GenerateRequest(prompt_token_ids=[[5], [6]], sampling=long,
                                                                 request_ids=["r0", "r1"])))
    await asyncio.sleep(0.05)
    await engine.abort(["unknown", "r0"])
    assert fake.aborts == ["r0"]  # unknown ids are not sent
    await asyncio.sleep(0.02)
    await engine.abort_all()
    outs = await asyncio.wait_for(task, 5)
    assert [c.finish_reason for c in outs] == ["abort", "abort"]
    assert all(0 < len(c.token_ids) < 250 for c in outs) and [c.request_id for c in outs] == ["r0", "r1"]
    assert None in fake.aborts
    await engine.abort(["r0"])  # finished: ignored
    await engine.abort_all()


async def test_pause_modes_map_to_sglang(tiny_model) -> None:
    import asyncio

    engine, fake = make(tiny_model)
    # wait: the request in flight finishes, then SGLang is paused in place; new ones are held.
    task = asyncio.ensure_future(engine.generate(GenerateRequest(prompt_token_ids=[[5]],
                                                                 sampling=SamplingParams(max_tokens=20))))
    await asyncio.sleep(0.01)
    await engine.pause("wait")
    assert task.done() and task.result()[0].finish_reason == "length" and fake.pause_modes == ["in_place"]
    held = asyncio.ensure_future(engine.generate(GenerateRequest(prompt_token_ids=[[5]], sampling=SamplingParams(max_tokens=2))))
    await asyncio.sleep(0.05)
    assert not held.done()
    await engine.resume()
    assert len((await held)[0].token_ids) == 2
    # abort: SGLang's mode 'abort'; requests in flight come back aborted with their tokens.
    task = asyncio.ensure_future(engine.generate(GenerateRequest(prompt_token_ids=[[5]],
                                                                 sampling=SamplingParams(max_tokens=250))))
    await asyncio.sleep(0.03)
    await engine.pause("abort")
    assert fake.pause_modes[-1] == "abort" and task.done()
    out = task.result()[0]
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 250
    await engine.resume()
    assert not fake.paused


async def paused_in_keep(engine: SglangEngine) -> asyncio.Future[list[Completion]]:
    """A greedy 250-token request running, then a ``keep`` pause: the request's task."""
    import asyncio

    task = asyncio.ensure_future(engine.generate(GenerateRequest(prompt_token_ids=[[5, 6]],
                                                                 sampling=SamplingParams(temperature=0.0, max_tokens=250))))
    await asyncio.sleep(0.05)
    await engine.pause("keep")
    return task


async def test_keep_push_resume_tags_tokens_with_their_weights(tiny_model) -> None:
    import asyncio

    engine, fake = make(tiny_model)
    task = await paused_in_keep(engine)
    assert fake.pause_modes == ["abort"] and not task.done()
    flushes = fake.flushes
    assert await push(engine, perturbed(checkpoint(tiny_model)), version=1) == 1
    assert fake.flushes == flushes + 1, "nothing waits in SGLang, so the push's prefix-cache flush succeeds"
    await engine.resume()
    out = (await asyncio.wait_for(task, 60))[0]
    versions = out.versions()
    switch = versions.index(1)
    assert 0 < switch < 250 and versions == [0] * switch + [1] * (250 - switch)
    assert out.token_weight_versions == versions and out.weight_version == 1
    assert out.token_ids[switch] != out.token_ids[0]  # the fake's tokens follow its weights
    # The suspended sequence went on as a new SGLang request: prompt + tokens so far, the rest of
    # its budget, a new rid, no prompt logprobs again.
    again = fake.generate_calls[-1]
    assert again["input_ids"] == [[5, 6, *out.token_ids[:switch]]]
    assert again["sampling_params"][0]["max_new_tokens"] == 250 - switch
    assert again["rid"] == [f"{out.request_id}~1"]
    assert out.text == engine.runtime.tokenizer.decode(out.token_ids, skip_special_tokens=True)


async def test_a_keep_pause_takes_a_push_that_flushes_the_prefix_cache(tiny_model) -> None:
    """SGLang's own keeping modes cannot: its flush fails while requests are paused in place or
    retracted (the fake refuses it too), and the push would fail after 5 s of retries."""
    import asyncio

    engine, fake = make(tiny_model)
    task = asyncio.ensure_future(engine.generate(GenerateRequest(prompt_token_ids=[[5, 6], [7]],
                                                                 sampling=SamplingParams(temperature=0.0, max_tokens=250, logprobs=0))))
    await asyncio.sleep(0.05)
    await fake.pause_mode("retract")
    with pytest.raises(RuntimeError, match="pending requests"):
        await fake.flush_cache()
    await fake.resume()
    await engine.pause("keep")
    assert await asyncio.wait_for(push(engine, perturbed(checkpoint(tiny_model)), version=1), 3) == 1
    await engine.resume()
    outs = await asyncio.wait_for(task, 60)
    for o in outs:
        assert len(o.token_ids) == 250 and o.finish_reason == "length" and o.versions()[-1] == 1
        assert o.logprobs is not None and len(o.logprobs) == 250


async def test_abort_of_a_suspended_sequence_ends_it_while_paused(tiny_model) -> None:
    import asyncio

    engine, fake = make(tiny_model)
    req = GenerateRequest(prompt_token_ids=[[5, 6]], request_ids=["r1"], sampling=SamplingParams(temperature=0.0, max_tokens=250))
    deltas: list[StreamDelta] = []

    async def consume() -> None:
        async for d in engine.stream(req):
            deltas.append(d)

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.05)
    await engine.pause("keep")
    await engine.abort(["r1"])
    await asyncio.wait_for(task, 1)  # while still paused
    assert deltas[-1].finish_reason == "abort" and [d.finish_reason for d in deltas].count("abort") == 1
    assert 0 < sum(len(d.token_ids) for d in deltas) < 250
    await engine.resume()
    assert len(fake.generate_calls) == 1, "an aborted sequence is not resubmitted"


async def test_tokens_made_before_a_keep_pause_keep_their_version_when_they_arrive_after_the_push(tiny_model) -> None:
    """Chunks made under the old weights can arrive after the pause returned (the fake's
    ``late_delivery`` holds them until release_late): they keep the version of the pause."""
    import asyncio

    engine, fake = make(tiny_model)
    fake.late_delivery = True
    task = asyncio.ensure_future(engine.generate(GenerateRequest(prompt_token_ids=[[5, 6]],
                                                                 sampling=SamplingParams(temperature=0.0, max_tokens=250))))
    await asyncio.sleep(0.05)
    await engine.pause("keep")
    assert await push(engine, perturbed(checkpoint(tiny_model)), version=1) == 1
    fake.release_late()  # the last chunk made under version 0 arrives now, after the push
    await asyncio.sleep(0.05)
    await engine.resume()
    out = (await asyncio.wait_for(task, 60))[0]
    versions = out.versions()
    switch = versions.index(1)
    assert 0 < switch < 250 and versions == [0] * switch + [1] * (250 - switch)
    # The fake makes one token per weight set for this prompt: the version says which weights made it.
    old, new = out.token_ids[0], out.token_ids[-1]
    assert old != new and out.token_ids == [old] * switch + [new] * (250 - switch)


async def test_continue_from_sends_prompt_and_earlier_tokens(tiny_model) -> None:
    engine, fake = make(tiny_model)
    s = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0)
    first = await engine.generate(GenerateRequest(prompt_token_ids=[[5, 6], [9]], sampling=s))
    await push(engine, perturbed(checkpoint(tiny_model)), version=4)
    more = await engine.generate(GenerateRequest(prompt_token_ids=[[5, 6], [9]], sampling=s, continue_from=first))
    assert fake.generate_calls[-1]["input_ids"] == [[5, 6, *first[0].token_ids], [9, *first[1].token_ids]]
    for m, f in zip(more, first, strict=True):
        assert m.token_ids[:3] == f.token_ids and len(m.token_ids) == 6 and m.prompt_token_ids == f.prompt_token_ids
        assert m.versions() == [0] * 3 + [4] * 3 and m.weight_version == 4
        assert m.logprobs == [-0.5] * 6
    with pytest.raises(InvalidRequest, match="logprob"):
        no_lp = await engine.generate(GenerateRequest(prompt_token_ids=[[5]], sampling=SamplingParams(max_tokens=1)))
        await engine.generate(GenerateRequest(prompt_token_ids=[[5]], sampling=s, continue_from=no_lp))


async def test_an_abort_pause_after_a_keep_pause_ends_the_suspended_sequences(tiny_model) -> None:
    import asyncio

    engine, fake = make(tiny_model)
    task = await paused_in_keep(engine)
    await asyncio.wait_for(engine.pause("abort"), 2)
    out = (await asyncio.wait_for(task, 1))[0]
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 250
    await engine.resume()
    assert len(fake.generate_calls) == 1


async def test_a_wait_pause_after_a_keep_pause_lets_the_suspended_sequences_finish(tiny_model) -> None:
    import asyncio

    engine, fake = make(tiny_model)
    task = await paused_in_keep(engine)
    await asyncio.wait_for(engine.pause("wait"), 60)  # it waited for sequences that could not run
    out = (await asyncio.wait_for(task, 1))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 250
    later = asyncio.ensure_future(engine.generate(GenerateRequest(prompt_token_ids=[[7]],
                                                                  sampling=SamplingParams(max_tokens=2))))
    await asyncio.sleep(0.05)
    assert not later.done()  # still paused: new requests wait
    await engine.resume()
    assert len((await asyncio.wait_for(later, 60))[0].token_ids) == 2


class _AbortsAfterTheLastToken(StreamingFakeSglangRuntime):
    """SGLang's abort of a running request sets ``req.to_abort``: the request still runs one decode
    step, and ``Req.check_finished`` tests ``to_abort`` before the length and stop-token checks
    (python/sglang/srt/managers/schedule_batch.py), so a request whose last token (its budget's
    last, or a stop token) came in that step ends as 'abort' with that token. Here the ``abort``
    pause lands in the step that makes each sequence's last token."""

    def _chunk(self, i, rid, ids, out, start, finish, kw, k_top):  # type: ignore[no-untyped-def]
        if finish is not None and self.pause_modes and self.paused:
            finish = {"type": "abort", "message": "Abort request", "status_code": None}
        return super()._chunk(i, rid, ids, out, start, finish, kw, k_top)

    async def pause_mode(self, mode: str) -> None:
        if mode != "abort":
            return await super().pause_mode(mode)
        self.pause_modes.append(mode)
        self.paused = True
        self._admit.clear()
        while self.live:  # each sequence runs to its last token, which ends it as 'abort'
            await asyncio.sleep(self.step_s)


async def test_a_sequence_a_keep_pause_ends_at_its_last_token_is_finished_not_resubmitted(tiny_model) -> None:
    """A sequence SGLang reports aborted by the ``keep`` pause although it has made its whole
    budget ends there as 'length' (a stop token: see test_translate); resubmitted, it would get one
    token more than max_tokens."""
    fake = _AbortsAfterTheLastToken(tiny_model, step_s=0.01)
    config = EngineConfig(backend="sglang", model=str(tiny_model), dtype="float32", options={"relay_device": "cpu"})
    engine = SglangEngine(config, runtime=fake)
    sampling = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)
    task = asyncio.ensure_future(engine.generate(GenerateRequest(prompt_token_ids=[[5, 6]], sampling=sampling)))
    await asyncio.sleep(0.015)
    await asyncio.wait_for(engine.pause("keep"), 5)
    await engine.resume()
    out = (await asyncio.wait_for(task, 5))[0]
    assert len(fake.generate_calls) == 1, "the finished sequence was resubmitted"
    assert len(out.token_ids) == 4 and len(out.logprobs or []) == 4 and out.finish_reason == "length"
    assert out.text == fake.tokenizer.decode(out.token_ids, skip_special_tokens=True)


async def test_direct_receive_makes_sglangs_scheduler_receive_updates_itself_while_nothing_runs(tiny_model) -> None:
    """Option ``direct_receive`` (``shm`` here; ``cuda_ipc`` on the GPU): after the first update,
    which the relay receives and hands to SGLang's call, SGLang's scheduler process (here the
    loader the fake runtime calls in-process, as SGLang's scheduler does in its own) joins the
    session as the relay's rank; later updates reach it through the doorbell and it reads the
    trainer's buckets itself, with no call of SGLang; calls into SGLang wait meanwhile; with a
    request outstanding the relay takes the update; a refused update changes nothing; closing the
    transfer stops the doorbell. The only fake besides the runtime: a load that fails midway."""
    engine, fake = make(tiny_model, weight_loaders=(LOADER,), copy_plan=True)
    sync = await connect_weight_sync([engine], "shm", bucket_bytes=64 * 1024)
    try:
        first = perturbed(checkpoint(tiny_model), 0.01)
        await sync.push(first, version=1)  # the relay: SGLang's call; then the doorbell starts
        target = engine._transfer.receiver.target
        assert target.door is not None and target.direct_receives == 0
        assert target.staging_bytes == 0  # the relay's staging buffer went: later updates skip it
        assert all(torch.equal(fake.weights[n], t) for n, t in first.items())
        calls = len(fake.load_formats)

        second = perturbed(checkpoint(tiny_model), 0.02)
        await sync.push(second, version=2)
        assert len(fake.load_formats) == calls  # through the store, not SGLang's call
        assert all(torch.equal(fake.weights[n], t) for n, t in second.items())
        assert target.direct_receives == 1 and engine._transfer.receiver.version == 2
        out = await engine.generate(GREEDY)
        assert out[0].weight_version == 2
        last = (await engine.diagnostics()).last_receive
        assert last is not None and last.direct and last.version == 2 and last.workers[0].apply_s > 0

        # While the scheduler receives, nothing goes to SGLang (its lock held here: the receive waits).
        loader._lock.acquire()
        try:
            pushing = asyncio.ensure_future(sync.push(first, version=3))
            for _ in range(100):
                if target.door.busy:
                    break
                await asyncio.sleep(0.01)
            flushes = fake.flushes
            waiting = asyncio.ensure_future(engine._unless_failed(fake.flush_cache()))
            await asyncio.sleep(0.1)
            assert target.door.busy and not waiting.done() and fake.flushes == flushes
        finally:
            loader._lock.release()
        await asyncio.wait_for(pushing, 10)
        await asyncio.wait_for(waiting, 10)
        assert fake.flushes > flushes and target.direct_receives == 2
        assert all(torch.equal(fake.weights[n], t) for n, t in first.items())

        engine._outstanding += 1  # a request in flight: the relay takes the update
        try:
            await sync.push(second, version=4)
        finally:
            engine._outstanding -= 1
        assert len(fake.load_formats) > calls and target.direct_receives == 2
        assert all(torch.equal(fake.weights[n], t) for n, t in second.items())

        # Refused before anything is applied (checked by the engine: the relay drains it).
        bad = {**second, "model.norm.weight": torch.ones(3)}
        with pytest.raises(WeightSyncError, match="rejected before applying anything"):
            await sync.push(bad, version=5)
        assert all(torch.equal(fake.weights[n], t) for n, t in second.items())
        assert target.direct_receives == 2 and not target.door.busy

        # A FAKE fault: the scheduler's load fails after its first bucket was applied.
        plan, real, seen = loader.planned_loader(fake.models[0]), None, []
        real = plan.apply

        def failing(named, load, **kw):  # noqa: ANN001, ANN202
            seen.append(1)
            if len(seen) == 2:
                raise RuntimeError("injected fault in the scheduler's load")
            return real(named, load, **kw)

        plan.apply = failing  # type: ignore[method-assign]
        try:
            with pytest.raises(WeightSyncError, match="injected fault"):
                await sync.push(first, version=6)
        finally:
            plan.apply = real  # type: ignore[method-assign]
        last = (await engine.diagnostics()).last_receive
        assert last is not None and last.direct and last.version == 6  # it went through the doorbell
        with pytest.raises(WeightsInvalidated):
            await engine.generate(GREEDY)
        await sync.push(first, version=7)  # a complete push: serving again, through the doorbell
        assert target.direct_receives == 3 and (await engine.generate(GREEDY))[0].weight_version == 7
        extra = (await engine.info()).extra
        assert extra["direct_receives"] == 3
        # Where the ring's time went: the scheduler's receive is part of the engine's wait.
        assert 0 < extra["door_receive_ms"] <= extra["door_ring_ms"] and extra["door_wake_ms"] is not None
    finally:
        await sync.close()
    assert engine._transfer is None and not list(loader._doors.items())  # FORGET_ALL stopped the doorbell


async def test_direct_receive_steps_aside_where_sglangs_scheduler_spins(tiny_model) -> None:
    """With ``sleep_on_idle=False`` passed (SGLang's scheduler then spins in Python between
    requests, holding the GIL the doorbell's thread would need: 143 ms pushes instead of 4.5 ms on
    an H100) no doorbell is started: every update goes through the relay and SGLang's call."""
    engine, fake = make(tiny_model, weight_loaders=(LOADER,), copy_plan=True, sleep_on_idle=False)
    sync = await connect_weight_sync([engine], "shm", bucket_bytes=64 * 1024)
    try:
        for version in (1, 2):
            calls = len(fake.load_formats)
            tensors = perturbed(checkpoint(tiny_model), 0.01 * version)
            await sync.push(tensors, version=version)
            assert len(fake.load_formats) > calls
            assert all(torch.equal(fake.weights[n], t) for n, t in tensors.items())
        target = engine._transfer.receiver.target
        assert target.door is None and not list(loader._doors.items())
    finally:
        await sync.close()


