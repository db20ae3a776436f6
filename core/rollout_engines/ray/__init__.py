"""Engines as Ray actors (``pip install "rollout-engines[ray]"``): any backend in an actor, placement
groups for engines and their workers, colocation with trainer workers, restart and rejoin.

    from rollout_engines.ray import acreate_ray_group, engine_placement_group

    pg = engine_placement_group(4, gpus_per_worker=1)
    group = await acreate_ray_group(4, "vllm", model=path, placement_group=pg, num_gpus=1, max_restarts=3,
                                    group_options={"on_rejoin": push_current_weights})

``import rollout_engines`` never imports Ray; this package does.
"""

from __future__ import annotations

try:
    import ray as _ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without ray
    from ..errors import BackendNotInstalled

    raise BackendNotInstalled("ray", 'pip install "rollout-engines[ray]"', cause=str(exc)) from exc

from .actor import EngineActor
from .engine import (
    RayEngine,
    acreate_ray_engines,
    acreate_ray_group,
    create_ray_engine,
    launch_engine_actor,
)
from .placement import (
    bundle_scheduling,
    colocated_options,
    engine_bundle_indices,
    engine_placement_group,
    node_of_bundles,
)

__all__ = [
    "EngineActor", "RayEngine", "acreate_ray_engines", "acreate_ray_group", "bundle_scheduling",
    "colocated_options", "create_ray_engine", "engine_bundle_indices", "engine_placement_group",
    "launch_engine_actor", "node_of_bundles",
]
