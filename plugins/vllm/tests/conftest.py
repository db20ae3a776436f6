"""Shared set-up of the vLLM plugin's tests: keep vLLM's caches out of the home folder and run
offline (the tiny model is local)."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "roe-vllm-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTHONUNBUFFERED", "1")


@pytest.fixture(scope="module")
def original(tiny_model):
    """The tiny model's checkpoint tensors (what a push restores)."""
    from rollout_engines.weights.checkpoint import load_checkpoint

    return load_checkpoint(tiny_model)
