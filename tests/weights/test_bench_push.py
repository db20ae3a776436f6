"""`rollout-engines bench push` end to end on the embedded backend: the pushes it times really land."""

from __future__ import annotations

import pytest


@pytest.mark.transformers
def test_push_benchmark_times_pushes_that_land(tiny_model):
    from rollout_engines.bench.push import run

    result = run({"backend": "transformers", "model": str(tiny_model), "pushes": 3, "transport": "shm",
                  "bucket_mb": 1, "option": ["dtype=\"float32\""]})
    assert result["perturbed_push_changed_weights"] is True
    assert result["original_push_restored_weights"] is True
    assert result["tensors"] > 10 and result["bytes"] > 1_000_000
    assert result["warmup_pushes"] == 4 and result["pushes"] == 3  # 4 untimed pushes first
    assert result["trainer_sets"] == 2  # the perturbed and the original, both kept on its device
    assert result["phases_median_s"]["push"] == pytest.approx(result["push_s"], rel=0.5)
    # every timed push, in order: the median, best and p90 are of these
    times = result["push_times_s"]
    assert len(times) == 3 and min(times) == result["best_push_s"] and max(times) == result["push_p90_s"]
    assert sorted(times)[1] == result["push_s"]
    # From the engine's diagnostics(): its receiver's own account of each push.
    phases = result["phases_median_s"]
    assert 0 < phases["worker_total"] <= phases["push"] and {"worker_wait", "worker_apply"} <= set(phases)
    # Of the wait, the part before the first bucket (how late the trainer started).
    assert 0 < phases["worker_wait_first"] <= phases["worker_wait"]
    # The trainer's side: its first bucket went out before its sender was done, within the push.
    assert 0 < phases["trainer_first_bucket"] <= phases["trainer_stream"] <= phases["push"]
    assert result["platform"] == "cpu" and result["fingerprint"] == "greedy tokens"
    assert result["engine_extra"]["weights"] and result["engine_extra"]["device"] == "cpu"  # what info() said
    # The same-run baseline: one copy of the state on the trainer's device; ratio relates the two.
    assert result["device_copy_gbps"] > 0
    # The host's Python speed, sampled beside that baseline: what the CPU-bound phases move with.
    speed = result["host_loop_us"]
    assert set(speed) == {"median", "min", "max"} and 0 < speed["min"] <= speed["median"] <= speed["max"]
    # gbps and the copy's rate are rounded to 0.01: on a slow, busy CPU that alone is a few percent.
    rounding = 0.005 * (1 + result["ratio"]) / result["device_copy_gbps"]
    assert result["ratio"] == pytest.approx(result["gbps"] / result["device_copy_gbps"], rel=0.02, abs=rounding + 1e-3)


@pytest.mark.transformers
def test_one_set_pushes_rewrite_the_same_tensors_and_land(tiny_model):
    """``--one-set``: the trainer holds one set of tensors, rewritten in place before each push (as
    an optimizer step does) from the two sets in host memory. The perturbed push still changes the
    engine's outputs and the originals still restore them, so every rewrite reached the engine."""
    import asyncio

    import rollout_engines as roe
    import torch
    from rollout_engines.bench.common import push_weights
    from rollout_engines.bench.push import run

    async def sets():
        engine = await roe.acreate_engine("transformers", model=str(tiny_model), dtype="float32")
        try:
            return await push_weights(engine, str(tiny_model), "shm", one_set=True)
        finally:
            await engine.close()

    weights = asyncio.run(sets())
    assert weights.live is not None and weights.live.keys() == weights.original.keys()
    name = next(n for n, t in weights.original.items() if t.is_floating_point())
    ptr = weights.live[name].data_ptr()
    assert weights.use(weights.changed) is weights.live
    assert torch.equal(weights.live[name], weights.changed[name]) and weights.live[name].data_ptr() == ptr
    weights.use(weights.original)
    assert torch.equal(weights.live[name], weights.original[name]) and weights.live[name].data_ptr() == ptr
    assert not torch.equal(weights.original[name], weights.changed[name])

    result = run({"backend": "transformers", "model": str(tiny_model), "pushes": 3, "transport": "shm",
                  "bucket_mb": 1, "one_set": True, "option": ["dtype=\"float32\""]})
    assert result["trainer_sets"] == 1
    assert result["perturbed_push_changed_weights"] is True and result["original_push_restored_weights"] is True
    assert result["bytes"] == sum(t.numel() * t.element_size() for t in weights.original.values())


@pytest.mark.transformers
def test_idle_before_each_push_is_untimed(tiny_model):
    """``--idle-s``: each push waits first (the trainer's step, here after the requests of
    ``--generate-between``); the wait is in the run's wall time, in no push's time, and every push
    still lands."""
    import time

    from rollout_engines.bench.push import run

    t0 = time.perf_counter()
    result = run({"backend": "transformers", "model": str(tiny_model), "pushes": 2, "warmup": 1, "transport": "shm",
                  "bucket_mb": 1, "option": ["dtype=\"float32\""], "generate_between": True, "idle_s": 0.4})
    wall = time.perf_counter() - t0
    assert result["idle_s"] == 0.4 and result["generate_between_pushes"] is True
    assert wall >= 3 * 0.4  # one warm-up and two timed pushes, each after its pause
    assert all(t < 0.4 for t in result["push_times_s"])  # a tiny model's push takes milliseconds
    assert result["perturbed_push_changed_weights"] is True and result["original_push_restored_weights"] is True
    with pytest.raises(ValueError, match=r"--idle-s must be >= 0, got -1\.0"):
        run({"backend": "transformers", "model": str(tiny_model), "idle_s": -1})


@pytest.mark.transformers
def test_lora_push_benchmark_pushes_adapters_that_land(tiny_model):
    """``--lora-rank``: the timed pushes are adapter pushes, sized by the rank; the engine lists the
    last version and the adapter changes greedy outputs (exact on the tiny float32 model)."""
    from rollout_engines.bench.push import run

    result = run({"backend": "transformers", "model": str(tiny_model), "pushes": 3, "transport": "shm",
                  "lora_rank": 4, "option": ["dtype=\"float32\""]})
    assert result["adapter_listed"] is True and result["adapter_changed_outputs"] is True
    assert result["lora_rank"] == 4 and result["lora_targets"] == ["q_proj", "v_proj"]
    assert result["tensors"] > 0 and result["tensors"] % 2 == 0  # one A and one B per target module
    # rank 4, float32: A is [4, in] and B is [out, 4] for every module; far below the full state
    assert 0 < result["bytes"] < 1_000_000 and result["push_s"] > 0
    # where a push's time went: the adapter's receive and its installation in the engine
    phases = result["phases_median_s"]
    assert 0 < phases["worker_install"] <= phases["worker_total"] <= phases["push"]
    # of the install, the installing thread's CPU time (the rest it waited)
    assert 0 < phases["worker_install_cpu"] <= phases["worker_install"] + 1e-5
    # what the engine said of itself while the transfer was open (e.g. vLLM's direct_receives)
    assert result["engine_extra"]["dtype"] == "float32" and result["engine_extra"]["device"] == "cpu"


@pytest.mark.transformers
def test_diagnostics_after_a_push(tiny_model):
    """``diagnostics()`` reports the last update by phase, the platform and the weights' dtype."""
    import asyncio

    import rollout_engines as roe
    from rollout_engines.weights.checkpoint import load_checkpoint

    async def go():
        engine = await roe.acreate_engine("transformers", model=str(tiny_model), dtype="float32")
        try:
            before = await engine.diagnostics()
            assert before.last_receive is None and before.platform == "cpu" and before.weights_dtype == "float32"
            sync = await roe.connect_weight_sync([engine], "inproc")
            try:
                await sync.push(load_checkpoint(str(tiny_model)), version=1)
            finally:
                await sync.close()
            return await engine.diagnostics(fingerprint=True)
        finally:
            await engine.close()

    after = asyncio.run(go())
    assert after.weight_version == 1 and after.last_receive is not None and after.last_receive.version == 1
    assert after.last_receive.rpc_s is None and len(after.last_receive.workers) == 1
    assert after.last_receive.workers[0].total_s > 0 and after.weights_fingerprint is None
