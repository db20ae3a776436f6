"""Registration of the vLLM backend: cheap, and importing neither vLLM nor torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


def test_registered_without_importing_vllm_or_torch():
    code = (
        "import json, sys\n"
        "from rollout_engines.plugins import get_registry\n"
        "r = get_registry()\n"
        "rec = {x.name: x for x in r.records()}['vllm']\n"
        "spec = r.backend('vllm')\n"
        "print(json.dumps({'installed': rec.installed, 'dist': rec.distribution, 'target': spec.target,\n"
        "  'heavy': [m for m in ('vllm', 'torch') if m in sys.modules]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {
        "installed": True, "dist": "rollout-engines-vllm",
        "target": "rollout_engines_vllm.engine:VllmEngine", "heavy": [],
    }


def test_unknown_option_types_fail_early(tiny_model):
    from pydantic import ValidationError
    from rollout_engines import create_engine

    with pytest.raises(ValidationError, match="weight_apply_mode"):
        create_engine("vllm", model=str(tiny_model), weight_apply_mode="sometimes")


def test_auto_dtype_is_the_checkpoint_dtype(tiny_model):
    """vLLM's own "auto" would run the float32 tiny model in half precision, and then a push of the
    checkpoint's own tensors would be rejected for their dtype."""
    from rollout_engines_vllm.engine import checkpoint_dtype

    assert checkpoint_dtype(str(tiny_model)) == "float32"
    assert checkpoint_dtype("not/a/local/dir") is None


def test_ray_bundles_reach_vllm_through_its_registration():
    """The core's device environment names no vLLM variable: the plugin's ``ray_bundle_env`` adds
    vLLM's bundle variables for workers its Ray executor starts, and only for executor 'ray'."""
    from rollout_engines.envs import RAY_NOSET, setup_device_env

    env = {"CUDA_VISIBLE_DEVICES": "1"}
    changes = setup_device_env("vllm", ray_bundle={"bundle_indices": [4, 5], "gpus_per_worker": 0.5}, environ=env)
    assert changes == {
        RAY_NOSET: "1", "CUDA_VISIBLE_DEVICES": None,
        "VLLM_RAY_BUNDLE_INDICES": "4,5", "VLLM_RAY_PER_WORKER_GPUS": "0.5",
    }
    assert env == {RAY_NOSET: "1", "VLLM_RAY_BUNDLE_INDICES": "4,5", "VLLM_RAY_PER_WORKER_GPUS": "0.5"}
    mp = setup_device_env("vllm", ray_bundle={"bundle_indices": [0], "executor": "mp", "gpu_ids": [3]}, environ={})
    assert mp == {RAY_NOSET: "1", "CUDA_VISIBLE_DEVICES": "3"}
