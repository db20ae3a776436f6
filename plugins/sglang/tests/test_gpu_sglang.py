"""SGLang on CUDA GPUs (real SGLang 0.5.17; skipped where SGLang or a GPU is missing).

The conformance suite runs against a real SGLang engine here (its async-RL tests included:
request ids, stream == generate, abort with partial tokens, pause wait/keep across a push, top and
prompt logprobs, continue_from), once more with SGLang's ``incremental_streaming_output`` (the
other stream-chunk format); the rest is what only SGLang on a GPU can show: sleep releases weights (generation refused until a push, then the original outputs
come back), every weight path (relayed CUDA IPC, disk, SGLang's own NCCL receive), small buckets
not garbling weights (sglang#14178), greedy agreement with the transformers engine in float32,
and tensor parallel 2. LoRA adapters (``enable_lora``): the core's LoRA conformance tests, and a
request keeping its adapter version across a push of the next one.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_engines import EngineConfig, GenerateRequest, SamplingParams, create_engine
from rollout_engines.errors import WeightsInvalidated
from rollout_engines.testing.conformance import AsyncRLTests, BackendConformance, LoraTests, make_lora
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed
from rollout_engines.weights.session import connect_weight_sync

pytestmark = [pytest.mark.sglang, pytest.mark.gpu, pytest.mark.timeout(900)]

#: Small enough to share the GPU with a second engine in the same test. Triton attention and the
#: PyTorch sampler need no kernels beyond SGLang's own (FA3 and flashinfer are optional builds).
OPTIONS = {"mem_fraction_static": 0.25, "disable_cuda_graph": True, "attention_backend": "triton",
           "sampling_backend": "pytorch", "start_timeout_s": 240}

REQUEST = GenerateRequest(
    prompt_token_ids=[[(i * 41) % 4000 + 10 for i in range(200)], [5, 6, 7, 8], [17] * 9],
    sampling=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
)


def two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def run(coro):
    return asyncio.run(coro)


async def tokens(engine, request=REQUEST):
    return [c.token_ids for c in await engine.generate(request)]


async def push(engine, tensors, version, transport, **kw):
    sync = await connect_weight_sync([engine], transport, timeout_s=120, **kw)
    try:
        return await sync.push(tensors, version=version)
    finally:
        await sync.close()


@pytest.mark.sglang
@pytest.mark.gpu
class TestSglangConformance(BackendConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def engine_config(cls, tiny_model):
        return EngineConfig(backend="sglang", model=str(tiny_model), dtype="bfloat16", options=OPTIONS)


@pytest.mark.sglang
@pytest.mark.gpu
class TestSglangAsyncRLIncrementalStream(AsyncRLTests):
    """The async-RL conformance tests (streaming, abort, pause modes, logprobs, continuation) with
    SGLang streaming only the new tokens of each step (chunks then carry deltas, not totals)."""

    @pytest.fixture(scope="class")
    @classmethod
    def engine_config(cls, tiny_model):
        return EngineConfig(backend="sglang", model=str(tiny_model), dtype="bfloat16",
                            options={**OPTIONS, "incremental_streaming_output": True})


@pytest.mark.sglang
@pytest.mark.gpu
class TestSglangLoraConformance(LoraTests):
    """The core's LoRA tests on an engine with SGLang's LoRA on (the conformance engine above has it
    off, so they skip there): adapters loaded from tensors, one batch mixing adapters and the base."""

    @pytest.fixture(scope="class")
    @classmethod
    def engine_config(cls, tiny_model):
        return EngineConfig(backend="sglang", model=str(tiny_model), dtype="bfloat16",
                            options={**OPTIONS, "enable_lora": True})


def test_lora_request_in_flight_keeps_its_version_across_a_push(tiny_model, original):
    """SGLang runs the version a request started with to its end; the retired version is unloaded
    from SGLang once that request is done."""
    eng = create_engine("sglang", model=str(tiny_model), dtype="bfloat16", enable_lora=True, **OPTIONS)

    async def go():
        spec, v1 = make_lora(original, "x", seed=1)
        _, v2 = make_lora(original, "x", seed=2)
        sync = await connect_weight_sync([eng], "cuda_ipc", timeout_s=120)
        try:
            await sync.push_lora(spec, v1, version=1)
            long = REQUEST.model_copy(update={"lora": "x", "sampling": REQUEST.sampling.model_copy(
                update={"max_tokens": 400})})
            solo = [c.token_ids for c in await eng.generate(long)]
            running = asyncio.ensure_future(eng.generate(long))
            while not eng._live:  # running in SGLang, on version 1
                await asyncio.sleep(0.001)
            await sync.push_lora(spec, v2, version=2)
            newer = await eng.generate(long)
            outs = await running
            return solo, outs, newer
        finally:
            await sync.close()

    try:
        solo, outs, newer = run(go())
        assert [c.token_ids for c in outs] == solo and {c.lora_version for c in outs} == {1}
        assert {c.lora_version for c in newer} == {2} and [c.token_ids for c in newer] != solo
        assert [x.sglang_name for x in eng._loras.active.values()] == ["x@v2#2"]
    finally:
        run(eng.close())


@pytest.fixture(scope="module")
def engine(tiny_model):
    # bfloat16: SGLang's CUDA RMSNorm has no float32 path (the engine refuses float32 unless
    # RMSNorm runs through the deterministic-inference Triton kernels, as in the agreement test).
    eng = create_engine("sglang", model=str(tiny_model), dtype="bfloat16", **OPTIONS)
    yield eng
    run(eng.close())


@pytest.fixture(scope="module")
def original(tiny_model):
    return load_checkpoint(tiny_model, dtype=torch.bfloat16)


def test_sleep_releases_weights_and_a_push_brings_the_outputs_back(engine, original):
    before = run(tokens(engine))
    run(engine.sleep(tags=["weights", "kv_cache"]))
    run(engine.wake_up())
    with pytest.raises(WeightsInvalidated, match="Push a complete set of weights"):
        run(tokens(engine))
    run(push(engine, original, engine.weight_version + 1, "cuda_ipc"))
    assert run(tokens(engine)) == before


def test_kv_cache_only_sleep_keeps_weights(engine):
    before = run(tokens(engine))
    run(engine.sleep(tags=["kv_cache"]))
    run(engine.wake_up())
    assert run(tokens(engine)) == before


@pytest.mark.parametrize("transport", ["cuda_ipc", "disk", "inproc"])
def test_push_changes_then_restores_outputs(engine, original, transport, tmp_path):
    kw = {"options": {"path": str(tmp_path)}} if transport == "disk" else {}
    reference = run(tokens(engine))
    v = engine.weight_version
    run(push(engine, perturbed(original), v + 1, transport, **kw))
    changed = run(engine.generate(REQUEST))
    assert [c.token_ids for c in changed] != reference and all(c.weight_version == v + 1 for c in changed)
    run(push(engine, original, v + 2, transport, **kw))
    assert run(tokens(engine)) == reference


@pytest.mark.parametrize("transport", ["cuda_ipc", "shm"])
def test_the_scheduler_receives_packed_buckets_through_the_doorbell(engine, original, transport):
    """Option ``direct_receive`` (on by default) with buckets the trainer packs (host tensors: IPC
    slots on the GPU for ``cuda_ipc``, shared memory for ``shm``): after the first update of a
    weight transfer, which the relay takes, SGLang's scheduler receives the rest itself, opening
    the trainer's slots there; each push changes or restores the greedy tokens."""
    async def go():
        reference = await tokens(engine)
        sync = await connect_weight_sync([engine], transport, timeout_s=120, bucket_bytes=1 << 20)
        try:
            seen = []
            for named in (perturbed(original, seed=7), original, perturbed(original, seed=8), original):
                await sync.push(named, version=engine.weight_version + 1)
                seen.append(await tokens(engine))
            return reference, seen, (await engine.info()).extra["direct_receives"]
        finally:
            await sync.close()

    reference, seen, direct = run(go())
    assert seen[1] == seen[3] == reference and seen[0] != reference and seen[2] != reference
    assert direct == 3


@pytest.mark.parametrize("bucket_bytes", [None, 4096])
def test_copy_plan_loader_records_then_replays_exactly(tiny_model, original, bucket_bytes):
    """Option ``copy_plan``: SGLang imports the plugin's loader; the first push records where each
    tensor lands, later ones copy directly. Each push is checked by the greedy tokens."""
    eng = create_engine("sglang", model=str(tiny_model), dtype="bfloat16", copy_plan=True, **OPTIONS)
    kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    try:
        reference = run(tokens(eng))
        for round_ in range(2):  # round 0 records, round 1 replays
            run(push(eng, perturbed(original, seed=round_ + 1), 2 * round_ + 1, "cuda_ipc", **kw))
            assert run(tokens(eng)) != reference
            run(push(eng, original, 2 * round_ + 2, "cuda_ipc", **kw))
            assert run(tokens(eng)) == reference
    finally:
        run(eng.close())


@pytest.mark.parametrize("direct", [False, True])
def test_buckets_of_the_trainers_tensors_are_forwarded_not_staged(tiny_model, original, direct):
    """Option ``forward_buckets``, ``cuda_ipc`` with the trainer's tensors on the GPU: the relay
    forwards each bucket's description and SGLang's loader reads the trainer's memory itself (no
    staging buffer). Kept tensors and temporaries (unmapped after each bucket), in one bucket and
    in many, all land: the perturbed weights change the greedy tokens and the originals bring
    them back. Option ``direct_receive`` (on by default): every push after the first goes through
    the doorbell to SGLang's scheduler process, which receives it from the trainer itself (no
    request runs between them); without it every push is forwarded by the relay."""
    from rollout_engines.weights.manifest import plan_manifest, specs_of
    from rollout_engines.weights.transports import _cuda_segments

    if not _cuda_segments.available():
        pytest.skip("forwarded buckets need cuda-bindings")
    engine = create_engine("sglang", model=str(tiny_model), dtype="bfloat16", forward_buckets=True,
                           direct_receive=direct, **OPTIONS)
    on_gpu = {n: t.cuda() for n, t in original.items()}
    changed = {n: t.cuda() for n, t in perturbed(original, seed=5).items()}

    async def go(bucket_bytes):
        reference = await tokens(engine)
        kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
        sync = await connect_weight_sync([engine], "cuda_ipc", timeout_s=120, **kw)
        try:
            seen = []
            for named in (changed, on_gpu, changed, on_gpu, {n: t.clone() for n, t in changed.items()}, on_gpu):
                await sync.push(named, version=engine.weight_version + 1)
                seen.append(await tokens(engine))
            target = engine._transfer.receiver.target
            buckets = len(plan_manifest(specs_of(list(on_gpu.items())), version=1, bucket_bytes=sync.bucket_bytes,
                                        transport="cuda_ipc", timeout_s=120).buckets)
            return reference, seen, target.forwarded, target._stager, buckets, target.direct_receives
        finally:
            await sync.close()

    try:
        for bucket_bytes in (None, 4096):
            reference, seen, forwarded, stager, buckets, received = run(go(bucket_bytes))
            assert seen[1] == seen[3] == seen[5] == reference
            assert seen[0] == seen[2] == seen[4] != reference
            assert forwarded == (1 if direct else 6) * buckets and stager is None
            assert (buckets > 1) == (bucket_bytes is not None)
            assert received == (5 if direct else 0)
    finally:
        run(engine.close())


def test_a_push_while_a_request_runs_goes_through_sglangs_call(tiny_model, original):
    """Option ``direct_receive``: the doorbell is used only while nothing runs in SGLang. A push
    while a request is in flight goes through SGLang's own call (which waits for the request),
    and every push lands either way."""
    from rollout_engines.weights.transports import _cuda_segments

    if not _cuda_segments.available():
        pytest.skip("forwarded buckets need cuda-bindings")
    engine = create_engine("sglang", model=str(tiny_model), dtype="bfloat16", **OPTIONS)
    on_gpu = {n: t.cuda() for n, t in original.items()}
    changed = {n: t.cuda() for n, t in perturbed(original, seed=5).items()}
    long = GenerateRequest(prompt_token_ids=[[5, 6, 7]],
                           sampling=SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))

    async def go():
        reference = await tokens(engine)
        sync = await connect_weight_sync([engine], "cuda_ipc", timeout_s=120)
        try:
            await sync.push(changed, version=1)  # the relay and SGLang's call; starts the doorbell
            await sync.push(on_gpu, version=2)  # the doorbell
            target = engine._transfer.receiver.target
            assert target.direct_receives == 1 and await tokens(engine) == reference
            running = asyncio.ensure_future(engine.generate(long))
            await asyncio.sleep(0.2)
            assert not running.done() and engine._outstanding == 1
            await sync.push(changed, version=3)
            assert target.direct_receives == 1
            await running
            after = await tokens(engine)
            await sync.push(on_gpu, version=4)  # idle again: the doorbell
            assert target.direct_receives == 2 and (await engine.info()).extra["direct_receives"] == 2
            return reference, after, await tokens(engine)
        finally:
            await sync.close()

    try:
        reference, changed_tokens, back = run(go())
        assert changed_tokens != reference and back == reference
    finally:
        run(engine.close())


@pytest.mark.parametrize("bucket_bytes", [4096, 65536 + 256])
def test_small_buckets_do_not_garble_weights(engine, original, bucket_bytes):
    """sglang#14178: updates split into many small buckets must load exactly what was sent."""
    reference = run(tokens(engine))
    v = engine.weight_version
    run(push(engine, perturbed(original, seed=3), v + 1, "cuda_ipc", bucket_bytes=1 << 30))
    one_bucket = run(tokens(engine))
    run(push(engine, original, v + 2, "cuda_ipc", bucket_bytes=bucket_bytes))
    assert run(tokens(engine)) == reference
    run(push(engine, perturbed(original, seed=3), v + 3, "cuda_ipc", bucket_bytes=bucket_bytes))
    assert run(tokens(engine)) == one_bucket
    run(push(engine, original, v + 4, "cuda_ipc"))


def test_greedy_agrees_with_the_transformers_engine(tiny_model):
    engine = create_engine("sglang", model=str(tiny_model), dtype="float32", enable_deterministic_inference=True,
                           **OPTIONS)
    hf = create_engine("transformers", model=str(tiny_model), dtype="float32", device="cuda")
    try:
        ours, theirs = run(engine.generate(REQUEST)), run(hf.generate(REQUEST))
        assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
        req = REQUEST.model_copy(update={"sampling": REQUEST.sampling.model_copy(update={"logprobs": 0})})
        a, b = run(engine.generate(req)), run(hf.generate(req))
        for x, y in zip(a, b, strict=True):
            assert x.token_ids == y.token_ids
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-2
    finally:
        run(hf.close())
        run(engine.close())


@pytest.mark.skipif(not two_gpus(), reason="sglang_nccl needs the trainer and the engine on different GPUs")
@pytest.mark.parametrize("bucket_bytes", [4096, 1 << 28])
def test_sglang_nccl_push_from_another_gpu(tiny_model, original, bucket_bytes):
    eng = create_engine("sglang", model=str(tiny_model), dtype="bfloat16", device="cuda:1", **OPTIONS)
    try:
        reference = run(tokens(eng))
        torch.cuda.set_device(0)
        on_gpu0 = {n: t.to("cuda:0") for n, t in original.items()}
        changed = {n: t.to("cuda:0") for n, t in perturbed(original).items()}

        async def go():
            sync = await connect_weight_sync([eng], "sglang_nccl", timeout_s=120, bucket_bytes=bucket_bytes)
            try:
                await sync.push(changed, version=1)
                mid = await tokens(eng)
                await sync.push(on_gpu0, version=2)  # the same group, a second update
                return mid, await tokens(eng)
            finally:
                await sync.close()

        mid, after = run(go())
        assert mid != reference and after == reference and eng.weight_version == 2
    finally:
        run(eng.close())


@pytest.mark.skipif(not two_gpus(), reason="tensor parallel 2 needs 2 GPUs")
def test_tensor_parallel_2_pushes_reach_both_ranks(tiny_model, original):
    eng = create_engine("sglang", model=str(tiny_model), dtype="bfloat16", tensor_parallel_size=2, **OPTIONS)
    try:
        assert run(eng.info()).extra["tp_size"] == 2
        reference = run(tokens(eng))
        run(push(eng, perturbed(original), 1, "cuda_ipc"))
        assert run(tokens(eng)) != reference
        run(push(eng, original, 2, "cuda_ipc", bucket_bytes=4096))
        assert run(tokens(eng)) == reference
        run(eng.sleep())
        run(eng.wake_up())
        with pytest.raises(WeightsInvalidated):
            run(tokens(eng))
        run(push(eng, original, 3, "cuda_ipc"))
        assert run(tokens(eng)) == reference
    finally:
        run(eng.close())


def test_stream_aborted_midway_ends_with_an_abort_delta(engine):
    async def go():
        request = GenerateRequest(prompt_token_ids=[[5, 6, 7]], request_ids=["gpu-stream-abort"],
                                  sampling=SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True,
                                                          logprobs=0, top_logprobs=2))
        got, last = [], None
        async for d in engine.stream(request):
            assert d.top_logprobs is not None and len(d.top_logprobs) == len(d.token_ids)
            got.extend(d.token_ids)
            last = d
            if len(got) >= 8 and d.finish_reason is None:
                await engine.abort(["gpu-stream-abort"])
        return got, last

    got, last = run(asyncio.wait_for(go(), 60))
    assert last is not None and last.finish_reason == "abort" and 8 <= len(got) < 2000
