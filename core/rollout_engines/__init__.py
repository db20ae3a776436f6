"""rollout-engines: one interface between RL trainers and the inference engines of their rollouts.

``import rollout_engines`` is light: torch and every engine library load only when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .engine import BlockingEngine, Capabilities, Engine, EngineProtocol
from .errors import (
    BackendLoadError,
    BackendNotInstalled,
    CapabilityError,
    DuplicateBackend,
    EngineAsleep,
    EngineClosed,
    EngineUnavailable,
    InvalidRequest,
    ManifestMismatch,
    RolloutEnginesError,
    StaleVersion,
    UnknownBackend,
    UnknownTransport,
    WeightsInvalidated,
    WeightSyncError,
)
from .factory import acreate_engine, create_engine
from .hookspecs import hookimpl
from .plugins import get_registry
from .spec import BackendEntry, BackendSpec, TransportEntry
from .types import (
    ChatMessage,
    Completion,
    EngineConfig,
    EngineInfo,
    GenerateRequest,
    LoraSpec,
    SamplingParams,
)
from .weights.manifest import ExpectedSpec, TensorSpec, TransportSpec, WeightManifest

__version__ = "0.1.0"

_LAZY = {
    "connect_weight_sync": ("rollout_engines.weights.session", "connect_weight_sync"),
    "WeightSync": ("rollout_engines.weights.session", "WeightSync"),
    "WeightReceiver": ("rollout_engines.weights.receiver", "WeightReceiver"),
    "WeightTarget": ("rollout_engines.weights.receiver", "WeightTarget"),
    "StateDictTarget": ("rollout_engines.weights.receiver", "StateDictTarget"),
    "EngineGroup": ("rollout_engines.group", "EngineGroup"),
}

if TYPE_CHECKING:
    from .group import EngineGroup
    from .weights.receiver import StateDictTarget, WeightReceiver, WeightTarget
    from .weights.session import WeightSync, connect_weight_sync


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'rollout_engines' has no attribute '{name}'")


__all__ = [
    "BackendEntry", "BackendLoadError", "BackendNotInstalled", "BackendSpec", "BlockingEngine", "Capabilities",
    "CapabilityError", "ChatMessage", "Completion", "DuplicateBackend", "Engine", "EngineAsleep", "EngineProtocol",
    "EngineClosed", "EngineConfig", "EngineGroup", "EngineInfo", "EngineUnavailable", "ExpectedSpec",
    "GenerateRequest", "InvalidRequest", "LoraSpec", "ManifestMismatch", "RolloutEnginesError", "SamplingParams",
    "StaleVersion", "StateDictTarget", "TensorSpec", "TransportEntry", "TransportSpec", "UnknownBackend",
    "UnknownTransport", "WeightManifest", "WeightReceiver", "WeightTarget", "WeightSync", "WeightSyncError",
    "WeightsInvalidated", "acreate_engine", "connect_weight_sync", "create_engine", "get_registry",
    "hookimpl", "__version__",
]
