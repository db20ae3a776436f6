"""``EngineGroup``: many engines (data-parallel replicas) behind one engine.

The package, along its seams (the behaviour is described in :mod:`rollout_engines.group.engine`):

- :mod:`~rollout_engines.group.membership`: what the group knows about each member, which errors
  mark a member down, health checks, and rejoin (bringing a member to the group's weight version);
- :mod:`~rollout_engines.group.router`: choosing the member a request goes to, and the queues
  requests wait in for a slot;
- :mod:`~rollout_engines.group.engine`: :class:`EngineGroup`, the engine (generate / stream,
  abort routing, fan-out, weight sync, close).
"""

from .engine import EngineGroup

# Every name of the former group.py module stays importable from here, private ones included.
from .membership import (  # noqa: F401
    CLIENT_ERRORS,
    ENGINE_FAILURES,
    NamedTensors,
    RejoinCallback,
    WeightSource,
    _load_source_dir,
    _Member,
    intersect_capabilities,
    logger,
)
from .router import ROUTINGS, Routing

__all__ = ["CLIENT_ERRORS", "ENGINE_FAILURES", "EngineGroup", "ROUTINGS", "Routing", "intersect_capabilities"]
