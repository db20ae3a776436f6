"""SGLang custom weight loaders that time themselves (for ``benchmarks/sglang_push_profile.py``).

SGLang imports them in its scheduler processes (``custom_weight_loader``); each call appends one
JSON line to ``$SGLANG_PROBE_LOG``: when it was entered, the seconds spent rebuilding the views of
the bucket, in the model's ``load_weights`` and waiting for the GPU, and when it returned.
``load_keep`` also keeps the payload's tensors alive until its next call (so SGLang's next CUDA IPC
import of the same buffer finds it open).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from rollout_engines_sglang.loader import PREFIX, bucket_views, parse_bucket_name

_KEPT: list[torch.Tensor] = []


def _load(model: Any, named_tensors: list[tuple[str, torch.Tensor]], keep: bool) -> None:
    t0 = time.time()
    named: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named_tensors:
        named += bucket_views(tensor, parse_bucket_name(name)) if name.startswith(PREFIX) else [(name, tensor)]
    t1 = time.time()
    model.load_weights(named)
    t2 = time.time()
    torch.cuda.current_stream().synchronize()
    t3 = time.time()
    if keep:
        _KEPT[:] = [t for _, t in named_tensors]
    with open(os.environ["SGLANG_PROBE_LOG"], "a") as f:
        f.write(json.dumps({"enter": t0, "views": t1 - t0, "load_weights": t2 - t1, "sync": t3 - t2, "exit": t3}) + "\n")


def load(model: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    _load(model, named_tensors, keep=False)


def load_keep(model: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    _load(model, named_tensors, keep=True)
