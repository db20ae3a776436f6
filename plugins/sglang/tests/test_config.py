"""EngineConfig -> sglang.Engine keyword arguments (pure)."""

from __future__ import annotations

import pytest
from rollout_engines.types import EngineConfig
from rollout_engines_sglang.engine import SglangOptions, capabilities_for, server_kwargs
from rollout_engines_sglang.loader import LOADER


def test_config_fields_and_passthrough_options() -> None:
    config = EngineConfig(
        backend="sglang", model="/m", dtype="float32", seed=7, max_model_len=512, tensor_parallel_size=2,
        device="cuda:3", options={"mem_fraction_static": 0.4, "disable_cuda_graph": True, "enable_deterministic_inference": True},
    )
    opts = SglangOptions.model_validate(config.options)
    kw = server_kwargs(config, opts)
    assert kw == {
        "model_path": "/m", "tokenizer_path": "/m", "dtype": "float32", "random_seed": 7, "tp_size": 2,
        "enable_memory_saver": True, "log_level": "error", "context_length": 512, "base_gpu_id": 3,
        "mem_fraction_static": 0.4, "enable_deterministic_inference": True, "disable_cuda_graph": True,
        "custom_weight_loader": [LOADER],  # copy_plan, on by default
        "sleep_on_idle": True,  # direct_receive, on by default: the doorbell's thread needs the GIL
    }
    assert capabilities_for(opts).seed is True
    # Plugin-only options never reach SGLang.
    opts = SglangOptions.model_validate({"relay_device": "cuda:1", "gpu_ids": [2, 3]})
    kw = server_kwargs(EngineConfig(backend="sglang", model="/m"), opts)
    assert "relay_device" not in kw and "gpu_ids" not in kw and "base_gpu_id" not in kw


def test_sleep_on_idle_follows_direct_receive_unless_passed() -> None:
    """The doorbell's thread in SGLang's scheduler needs the GIL, which SGLang's idle loop holds
    unless it sleeps on its sockets: the plugin turns SGLang's sleep_on_idle on with the doorbell,
    never against an explicit choice, and not where the doorbell is off."""
    config = EngineConfig(backend="sglang", model="/m")

    def kw(**options):
        return server_kwargs(config, SglangOptions.model_validate(options))

    assert kw()["sleep_on_idle"] is True
    assert kw(sleep_on_idle=False)["sleep_on_idle"] is False
    for off in ({"direct_receive": False}, {"copy_plan": False}):
        assert "sleep_on_idle" not in kw(**off)


def test_cpu_device_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="use device='cuda'"):
        server_kwargs(EngineConfig(backend="sglang", model="/m", device="cpu"), SglangOptions())
    with pytest.raises(ValueError):
        SglangOptions.model_validate({"mem_fraction_static": 1.5})


def test_float32_is_refused_unless_rmsnorm_runs_through_the_triton_kernels() -> None:
    """SGLang's CUDA RMSNorm kernel is half precision only: the scheduler would crash on the first
    request (and take the trainer down with its SIGQUIT); the engine refuses it up front."""
    from rollout_engines.errors import CapabilityError

    with pytest.raises(CapabilityError, match="dtype='bfloat16'"):
        server_kwargs(EngineConfig(backend="sglang", model="/m", dtype="float32"), SglangOptions())
    kw = server_kwargs(EngineConfig(backend="sglang", model="/m", dtype="bfloat16"), SglangOptions())
    assert kw["dtype"] == "bfloat16"


def test_copy_plan_adds_the_plugins_weight_loader_to_sglangs_own() -> None:
    config = EngineConfig(backend="sglang", model="/m")
    on = SglangOptions.model_validate({"copy_plan": True})
    assert server_kwargs(config, on)["custom_weight_loader"] == [LOADER]
    mine = SglangOptions.model_validate({"custom_weight_loader": ["my_pkg.load"], "copy_plan": True})
    assert server_kwargs(config, mine)["custom_weight_loader"] == ["my_pkg.load", LOADER]
    again = SglangOptions.model_validate({"custom_weight_loader": [LOADER], "copy_plan": True})
    assert server_kwargs(config, again)["custom_weight_loader"] == [LOADER]
    assert server_kwargs(config, SglangOptions())["custom_weight_loader"] == [LOADER]  # the default
    off = SglangOptions.model_validate({"copy_plan": False})
    assert "custom_weight_loader" not in server_kwargs(config, off)


@pytest.mark.parametrize(("option", "where"), [
    ("random_seed", "EngineConfig.seed"), ("context_length", "EngineConfig.max_model_len")
])
def test_arguments_the_engine_sets_are_refused_as_options_saying_where_they_go(option, where) -> None:
    config = EngineConfig(backend="sglang", model="/m", max_model_len=512, options={option: 1})
    with pytest.raises(ValueError, match=f"{option}' is set by rollout-engines; use {where}"):
        server_kwargs(config, SglangOptions.model_validate(config.options))
