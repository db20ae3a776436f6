"""vLLM on a CUDA GPU: sleep-mode traps and the GPU weight transports (they run where CUDA is visible).

The conformance suite (test_conformance_vllm.py) runs there too and covers sleep/wake, level 2
and wake-up without a stale prefix cache; this file adds what only a GPU can show.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_engines import GenerateRequest, SamplingParams, create_engine
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed
from rollout_engines.weights.session import connect_weight_sync

pytestmark = [pytest.mark.vllm, pytest.mark.gpu, pytest.mark.timeout(900)]

LONG = GenerateRequest(
    prompt_token_ids=[[(i * 41) % 4000 + 10 for i in range(300)], [5, 6, 7, 8]],
    sampling=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
)


def run(coro):
    return asyncio.run(coro)


async def tokens(engine, request=LONG):
    return [c.token_ids for c in await engine.generate(request)]


async def checksums(engine):
    return await engine._on_loop(lambda: engine._llm.collective_rpc("roe_param_checksum"))


def test_second_sleep_mode_engine_is_a_clear_error(tiny_model):
    from rollout_engines_vllm.engine import SleepModeEngineExists

    first = create_engine("vllm", model=str(tiny_model), dtype="float32", gpu_memory_utilization=0.2)
    try:
        assert first.sleep_mode and first.capabilities.supports_sleep()
        with pytest.raises(SleepModeEngineExists, match="enable_sleep_mode=False"):
            create_engine("vllm", model=str(tiny_model), dtype="float32", gpu_memory_utilization=0.2)
        # Without sleep mode a second engine is fine, and declares no sleep.
        plain = create_engine("vllm", model=str(tiny_model), dtype="float32", gpu_memory_utilization=0.2,
                              enable_sleep_mode=False)
        assert not plain.capabilities.supports_sleep()
        run(plain.close())
    finally:
        run(first.close())
    again = create_engine("vllm", model=str(tiny_model), dtype="float32", gpu_memory_utilization=0.2)
    run(again.close())


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = create_engine("vllm", model=str(tiny_model), dtype="float32", gpu_memory_utilization=0.3)
    yield eng
    run(eng.close())


def test_wake_up_serves_fresh_cache_and_level2_needs_a_push(engine, tiny_model):
    async def go():
        before = await tokens(engine)
        await engine.sleep(level=1)
        await engine.wake_up(tags=["weights"])
        await engine.wake_up(tags=["kv_cache"])
        assert await tokens(engine) == before
        await engine.sleep(level=2)
        await engine.wake_up()
        from rollout_engines.errors import WeightsInvalidated

        with pytest.raises(WeightsInvalidated):
            await engine.generate(LONG)
        sync = await connect_weight_sync([engine], "cuda_ipc")
        try:
            original = {k: v.cuda() for k, v in load_checkpoint(tiny_model).items()}
            await sync.push(original, version=engine.weight_version + 1)
            # direct_receive is on by default for CUDA: the push after the sleep rang the workers
            assert (await engine.diagnostics()).last_receive.direct is True
        finally:
            await sync.close()
        assert await tokens(engine) == before

    run(go())


@pytest.mark.parametrize(("transport", "options"), [
    ("cuda_ipc", {}), ("cuda_ipc", {"direct": False}), ("shm", {}), ("disk", {}), ("gloo", {}),
], ids=["cuda_ipc", "cuda_ipc-packed", "shm", "disk", "gloo"])
def test_gpu_push_changes_then_restores_weights(engine, tiny_model, transport, options):
    """Packed transports (``cuda_ipc`` without zero-copy, ``shm``) from the second push on hand the
    workers the views of their slots they kept, which vLLM's copy plan then replays."""
    device = "cuda" if transport == "cuda_ipc" else "cpu"

    async def go():
        original = {k: v.to(device) for k, v in load_checkpoint(tiny_model).items()}
        changed = {k: v.to(device) for k, v in perturbed(load_checkpoint(tiny_model)).items()}
        before, sums = await tokens(engine), await checksums(engine)
        sync = await connect_weight_sync([engine], transport, bucket_bytes=1 << 20, options=options)
        try:
            for _ in range(2):  # the second round runs on the recorded copy plan
                await sync.push(changed, version=engine.weight_version + 1)
                # by default (CUDA) every transport with a store rings the workers; disk takes the RPC
                assert (await engine.diagnostics()).last_receive.direct is (transport != "disk")
                assert await tokens(engine) != before
                assert await checksums(engine) != sums
                await sync.push(original, version=engine.weight_version + 1)
                assert await tokens(engine) == before
                assert await checksums(engine) == sums
        finally:
            await sync.close()

    run(go())


def test_doorbell_pushes_land_on_the_gpu(tiny_model):
    """Option direct_receive on CUDA: the worker's doorbell thread (not vLLM's engine-core thread)
    selects the worker's device, records the copy plan and its CUDA graphs, and replays them."""
    async def go():
        eng = await asyncio.to_thread(create_engine, "vllm", model=str(tiny_model), dtype="float32",
                                      gpu_memory_utilization=0.2, enable_sleep_mode=False, direct_receive=True)
        try:
            original = {k: v.cuda() for k, v in load_checkpoint(tiny_model).items()}
            changed = {k: v.cuda() for k, v in perturbed(load_checkpoint(tiny_model)).items()}
            before, sums = await tokens(eng), await checksums(eng)
            sync = await connect_weight_sync([eng], "cuda_ipc", bucket_bytes=1 << 20)
            try:
                for _ in range(3):
                    await sync.push(changed, version=eng.weight_version + 1)
                    assert (await eng.diagnostics()).last_receive.direct is True
                    assert await tokens(eng) != before and await checksums(eng) != sums
                    await sync.push(original, version=eng.weight_version + 1)
                    assert await tokens(eng) == before and await checksums(eng) == sums
            finally:
                await sync.close()
            assert (await eng.info()).extra["direct_receives"] == 6
        finally:
            await eng.close()

    run(go())


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="nccl needs 2 GPUs")
def test_nccl_push_from_another_gpu(tiny_model, monkeypatch):
    import os

    # gpu_ids sets CUDA_VISIBLE_DEVICES for the engine's processes; restore it after the test.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "0,1"))
    eng = create_engine("vllm", model=str(tiny_model), dtype="float32", gpu_memory_utilization=0.3,
                        gpu_ids=[1], enable_sleep_mode=False)

    async def go():
        before = await tokens(eng)
        changed = {k: v.to("cuda:0") for k, v in perturbed(load_checkpoint(tiny_model)).items()}
        sync = await connect_weight_sync([eng], "nccl")
        try:
            await sync.push(changed, version=1)
            assert await tokens(eng) != before
        finally:
            await sync.close()
            await eng.close()

    run(go())
