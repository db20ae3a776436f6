"""Placement groups for engines and their workers, and colocation with trainer workers.

One bundle per engine worker: engine ``i`` of ``workers_per_engine`` workers owns bundles
``i*w .. i*w + w - 1`` (:func:`engine_bundle_indices`). The engine's actor is placed on its first
bundle; an engine that starts its own workers through Ray (vLLM's Ray executor) places them on the
others (pass ``ray_bundle=RayBundle(bundle_indices=...)`` to ``create_ray_engine``; the device
environment is set by :func:`rollout_engines.envs.setup_device_env`).

Colocation: a trainer worker and an engine share a bundle, each taking a fraction of it
(:func:`colocated_options`), e.g. ``num_gpus=0.5`` each on a bundle of one GPU, so the engine
sleeps while the trainer steps and weights move over ``cuda_ipc``.
"""

from __future__ import annotations

from typing import Any, Literal

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..errors import EngineUnavailable

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


def engine_placement_group(
    num_engines: int,
    *,
    workers_per_engine: int = 1,
    cpus_per_worker: float = 1.0,
    gpus_per_worker: float = 0.0,
    strategy: Strategy = "PACK",
    name: str = "",
    ready_timeout_s: float = 120.0,
) -> PlacementGroup:
    """Reserve one bundle per engine worker and wait until the cluster placed them all."""
    if num_engines < 1 or workers_per_engine < 1:
        raise ValueError("num_engines and workers_per_engine must be >= 1")
    bundle: dict[str, float] = {"CPU": cpus_per_worker}
    if gpus_per_worker:
        bundle["GPU"] = gpus_per_worker
    pg = placement_group([dict(bundle) for _ in range(num_engines * workers_per_engine)], strategy=strategy, name=name)
    wait_ready(pg, ready_timeout_s)
    return pg


def wait_ready(pg: PlacementGroup, timeout_s: float) -> None:
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise EngineUnavailable(
            f"the placement group of {len(pg.bundle_specs)} bundles {pg.bundle_specs[:2]}... was not placed within "
            f"{timeout_s} s: the cluster lacks the resources (see `ray status`); ask for fewer or smaller bundles"
        )


def engine_bundle_indices(engine_index: int, workers_per_engine: int = 1) -> tuple[int, ...]:
    """The bundles of engine ``engine_index`` (its actor sits on the first)."""
    start = engine_index * workers_per_engine
    return tuple(range(start, start + workers_per_engine))


def bundle_scheduling(pg: PlacementGroup, bundle_index: int) -> PlacementGroupSchedulingStrategy:
    """Place an actor on one bundle; tasks and actors it starts stay in the placement group."""
    if not 0 <= bundle_index < len(pg.bundle_specs):
        raise ValueError(f"bundle_index {bundle_index} is outside the placement group's {len(pg.bundle_specs)} bundles")
    return PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=bundle_index, placement_group_capture_child_tasks=True
    )


def colocated_options(pg: PlacementGroup, bundle_index: int, fraction: float) -> dict[str, Any]:
    """``ActorClass.options(**...)`` for an actor that takes ``fraction`` of a bundle's CPUs and
    GPUs, so a trainer worker and an engine can share one bundle (and one GPU)."""
    if not 0 < fraction <= 1:
        raise ValueError("fraction must be in (0, 1]")
    spec = pg.bundle_specs[bundle_index]
    return {
        "num_cpus": spec.get("CPU", 0) * fraction,
        "num_gpus": spec.get("GPU", 0) * fraction,
        "scheduling_strategy": bundle_scheduling(pg, bundle_index),
    }


def node_of_bundles(pg: PlacementGroup) -> list[str]:
    """The node id of every bundle (where the cluster put them)."""
    table = ray.util.placement_group_table(pg)
    nodes = table.get("bundles_to_node_id", {})
    return [nodes[i] for i in range(len(pg.bundle_specs))]
