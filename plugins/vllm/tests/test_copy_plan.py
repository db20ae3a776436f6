"""The copy plan lives in the core (tests/weights/test_copy_plan.py tests it); the vLLM plugin's
module re-exports it and its worker extension loads through it."""

from __future__ import annotations

import rollout_engines.weights.copy_plan as core
from rollout_engines_vllm import copy_plan


def test_plugin_module_reexports_the_core_copy_plan() -> None:
    assert copy_plan.CopyPlan is core.CopyPlan
    assert copy_plan.record_copy_plan is core.record_copy_plan
    assert copy_plan.PlannedLoader is core.PlannedLoader
