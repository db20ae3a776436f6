"""What an update may carry, read from the model directory's safetensors headers (no tensor data)."""

from __future__ import annotations

import json
from pathlib import Path

from rollout_engines.weights.checkpoint import checkpoint_specs

__all__ = ["checkpoint_specs", "model_config"]


def model_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}
