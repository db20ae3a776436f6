"""Shared set-up of the vLLM plugin's tests: keep vLLM's caches out of the home folder and run
offline (the tiny model is local)."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "roe-vllm-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTHONUNBUFFERED", "1")
