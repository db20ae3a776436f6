"""The one place that sets an engine process's device environment (CUDA_VISIBLE_DEVICES, Ray)."""

from __future__ import annotations

import pytest
from rollout_engines.envs import RAY_NOSET, RayBundle, setup_device_env


def test_gpu_ids_set_visible_devices():
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "OTHER": "x"}
    changes = setup_device_env("sglang", gpu_ids=[2, 3], environ=env)
    assert changes == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3", "OTHER": "x"}


def test_ray_executor_sees_the_node_and_gets_bundles():
    env = {"CUDA_VISIBLE_DEVICES": "1"}
    changes = setup_device_env("vllm", ray_bundle={"bundle_indices": [4, 5], "gpus_per_worker": 0.5}, environ=env)
    assert changes == {
        RAY_NOSET: "1", "CUDA_VISIBLE_DEVICES": None,
        "VLLM_RAY_BUNDLE_INDICES": "4,5", "VLLM_RAY_PER_WORKER_GPUS": "0.5",
    }
    assert env == {RAY_NOSET: "1", "VLLM_RAY_BUNDLE_INDICES": "4,5", "VLLM_RAY_PER_WORKER_GPUS": "0.5"}


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


GUARD_SCRIPT = """
import os, signal, threading, time
from rollout_engines.envs import guard_child_failure_signal, install_child_failure_guard

hits = []
assert install_child_failure_guard()
box = {}
# An engine created on a loop thread registers there (where no handler can be installed).
t = threading.Thread(target=lambda: box.setdefault("unregister", guard_child_failure_signal(lambda: hits.append(1))))
t.start(); t.join()
os.kill(os.getpid(), signal.SIGQUIT)
time.sleep(0.2)
print("survived", hits, flush=True)
box["unregister"]()
os.kill(os.getpid(), signal.SIGQUIT)  # no engine left: the default action ends the process
time.sleep(2)
print("still alive", flush=True)
"""


def test_sigquit_guard_protects_while_an_engine_is_registered_and_not_after():
    """SGLang's failing workers SIGQUIT their parent: with an engine registered (even from another
    thread) the trainer survives and the engine hears of it; with none, SIGQUIT acts as before."""
    import signal
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", GUARD_SCRIPT], capture_output=True, text=True, timeout=60)
    assert "survived [1]" in proc.stdout, proc.stderr
    assert "still alive" not in proc.stdout
    assert proc.returncode == -signal.SIGQUIT
