"""The one place that sets an engine process's device environment (CUDA_VISIBLE_DEVICES, Ray)."""

from __future__ import annotations

import pytest
from rollout_engines import BackendEntry, hookimpl
from rollout_engines.envs import RAY_NOSET, RayBundle, setup_device_env
from rollout_engines.plugins import Registry, reset_registry


def test_gpu_ids_set_visible_devices():
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "OTHER": "x"}
    changes = setup_device_env("sglang", gpu_ids=[2, 3], environ=env)
    assert changes == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3", "OTHER": "x"}


def placed_env(bundle: RayBundle) -> dict[str, str]:
    """The ``ray_bundle_env`` of the test backend 'placed': what its library would read."""
    return {"PLACED_BUNDLES": ",".join(map(str, bundle.bundle_indices)), "PLACED_GPUS": repr(bundle.gpus_per_worker)}


class _PlacedPlugin:
    @hookimpl
    def register_backends(self, register):
        register(BackendEntry(name="placed", target="placed_lib:Engine", install_hint="-",
                             ray_bundle_env=f"{__name__}:placed_env"))


@pytest.fixture
def placed_backend():
    registry = Registry()
    registry.add_plugin(_PlacedPlugin(), name="placed")
    reset_registry(registry)
    yield
    reset_registry(None)


def test_ray_executor_sees_the_node_and_gets_the_backends_bundle_variables(placed_backend):
    env = {"CUDA_VISIBLE_DEVICES": "1"}
    changes = setup_device_env("placed", ray_bundle={"bundle_indices": [4, 5], "gpus_per_worker": 0.5}, environ=env)
    assert changes == {RAY_NOSET: "1", "CUDA_VISIBLE_DEVICES": None, "PLACED_BUNDLES": "4,5", "PLACED_GPUS": "0.5"}
    assert env == {RAY_NOSET: "1", "PLACED_BUNDLES": "4,5", "PLACED_GPUS": "0.5"}


def test_a_backend_without_bundle_variables_gets_only_the_generic_ones(placed_backend):
    """The core names no engine library's variables: a backend that declares none gets none."""
    env = {"CUDA_VISIBLE_DEVICES": "1"}
    for backend in ("transformers", "vllm", "unknown"):  # vllm is not registered in this registry
        changes = setup_device_env(backend, ray_bundle={"bundle_indices": [4, 5]}, environ=dict(env))
        assert changes == {RAY_NOSET: "1", "CUDA_VISIBLE_DEVICES": None}


def test_mp_executor_in_a_ray_actor_sees_its_assigned_gpus():
    env: dict[str, str] = {}
    bundle = RayBundle(bundle_indices=(0,), executor="mp", gpu_ids=(3,))
    setup_device_env("sglang", ray_bundle=bundle, environ=env)
    assert env == {RAY_NOSET: "1", "CUDA_VISIBLE_DEVICES": "3"}


def test_apply_false_leaves_the_environment_alone():
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    assert setup_device_env("vllm", gpu_ids=[1], environ=env, apply=False) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert setup_device_env("vllm", environ=env) == {}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gpu_ids": []}, "gpu_ids is empty"),
        ({"gpu_ids": [0], "ray_bundle": {"bundle_indices": [0]}}, "not both"),
        ({"ray_bundle": {"bundle_indices": []}}, "bundle_indices is empty"),
        ({"ray_bundle": {"bundle_indices": [0], "executor": "mp"}}, "needs ray_bundle.gpu_ids"),
    ],
)
def test_bad_input_says_what_to_do(kwargs, match):
    with pytest.raises(ValueError, match=match):
        setup_device_env("vllm", environ={}, **kwargs)
