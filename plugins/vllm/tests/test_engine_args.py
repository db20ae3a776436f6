"""What the engine asks vLLM for (AsyncEngineArgs), checked without starting vLLM: tensor
parallel executors, Ray placement, platform defaults and the worker extension."""

from __future__ import annotations

import pytest
from rollout_engines import EngineConfig
from rollout_engines.engine import Engine

pytestmark = pytest.mark.vllm


def args_for(model: str, platform: str = "cpu", **config):
    from rollout_engines_vllm.engine import VllmEngine, VllmOptions

    engine = VllmEngine.__new__(VllmEngine)
    cfg = EngineConfig(backend="vllm", model=model, **config)
    Engine.__init__(engine, cfg)
    engine.options = VllmOptions.model_validate(cfg.options)
    engine.platform, engine.sleep_mode = platform, platform == "cuda"
    return engine.engine_args()


def test_cpu_defaults_and_worker_extension(tiny_model):
    args = args_for(str(tiny_model))
    assert args.worker_extension_cls == "rollout_engines_vllm.worker_ext.WorkerExtension"
    assert args.enforce_eager is True
    assert args.kv_cache_memory_bytes == 256 * 2**20
    assert args.dtype == "float32"  # "auto" is the checkpoint's dtype
    assert args.enable_sleep_mode is False
    assert args.tensor_parallel_size == 1


def test_cuda_defaults(tiny_model):
    args = args_for(str(tiny_model), platform="cuda", dtype="bfloat16", options={"gpu_memory_utilization": 0.4})
    assert args.enable_sleep_mode is True
    assert args.dtype == "bfloat16"
    assert args.gpu_memory_utilization == 0.4  # unknown options pass through to vLLM
    assert not args.enforce_eager


@pytest.mark.parametrize(("platform", "option", "used"), [
    ("cuda", None, True), ("cpu", None, False), ("cuda", False, False), ("cpu", True, True),
])
def test_direct_receive_defaults_to_the_platform(platform, option, used):
    """The doorbell (option direct_receive) is on by default where it was measured faster (CUDA),
    off on the CPU; an explicit option wins on either."""
    from rollout_engines_vllm.engine import VllmOptions, direct_receive_default

    options = VllmOptions.model_validate({} if option is None else {"direct_receive": option})
    assert direct_receive_default(platform, options.direct_receive) is used


@pytest.mark.parametrize(("options", "message"), [
    ({"gpu_memory_utilisation": 0.5}, "unknown option 'gpu_memory_utilisation'.*did you mean 'gpu_memory_utilization'"),
    ({"seed": 3}, "'seed' is set by rollout-engines; use EngineConfig.seed"),
    ({"disable_log_stats": False}, "use the option log_stats"),
    ({"enable_lora": True, "max_cpu_loras": 8}, "use the option max_loras"),
])
def test_options_vllm_would_refuse_or_the_engine_overrides_are_refused(tiny_model, options, message):
    with pytest.raises(ValueError, match=message):
        args_for(str(tiny_model), options=options)


@pytest.mark.parametrize(
    ("tp", "options", "executor"),
    [
        (2, {}, "mp"),
        (2, {"distributed_executor_backend": "ray"}, "ray"),
        (4, {"ray_bundle": {"bundle_indices": [0, 1, 2, 3]}}, "ray"),
        (1, {"ray_bundle": {"bundle_indices": [0], "executor": "mp", "gpu_ids": [0]}}, None),
    ],
)
def test_tensor_parallel_executor(tiny_model, tp, options, executor):
    args = args_for(str(tiny_model), tensor_parallel_size=tp, options=options)
    assert args.tensor_parallel_size == tp
    if executor is not None:
        assert args.distributed_executor_backend == executor
    else:
        assert args.distributed_executor_backend in (None, "mp", "uni")
