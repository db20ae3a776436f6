"""``create_engine``: config in, running engine out, whatever the backend."""

from __future__ import annotations

import asyncio
from typing import Any

from .engine import EngineProtocol
from .options import engine_config
from .plugins import get_registry
from .types import EngineConfig


def create_engine(backend: str | EngineConfig = "transformers", model: str | None = None, **kwargs: Any) -> EngineProtocol:
    """Start an engine of ``backend`` on ``model``.

    Unknown keyword arguments that are not :class:`EngineConfig` fields go to ``options`` (the
    backend's own settings), so ``create_engine("vllm", model=p, enforce_eager=True)`` works.
    Given an :class:`EngineConfig`, the config holds every setting: ``model`` or keyword arguments
    beside it are a ``TypeError`` (they would otherwise be dropped).
    """
    config = engine_config(backend, model, kwargs)
    registry = get_registry()
    cls = registry.load_backend(config.backend)
    engine = cls(config)
    registry.hooks.engine_created(engine=engine)
    return engine


async def acreate_engine(backend: str | EngineConfig = "transformers", model: str | None = None, **kwargs: Any) -> EngineProtocol:
    """:func:`create_engine` in a worker thread, so model loading does not block the event loop."""
    return await asyncio.to_thread(create_engine, backend, model, **kwargs)
