"""Copy plans now live in the core (:mod:`rollout_engines.weights.copy_plan`), shared with the SGLang
plugin; these names stay importable from here."""

from rollout_engines.weights.copy_plan import CopyPlan, PlannedLoader, record_copy_plan

__all__ = ["CopyPlan", "PlannedLoader", "record_copy_plan"]
