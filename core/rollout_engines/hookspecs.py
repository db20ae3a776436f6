"""Pluggy hook specifications. A plugin is a module (named by an entry point in the group
``rollout_engines``) with functions marked ``@hookimpl``::

    from rollout_engines import hookimpl, BackendEntry

    @hookimpl
    def register_backends(register):
        register(BackendEntry(name="mybackend", target="my_pkg.engine:MyEngine",
                             install_hint='pip install "rollout-engines-mybackend"'))

Registration must be cheap and import no engine library: the class named by ``target`` is
imported only when an engine of that backend is created.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import pluggy

if TYPE_CHECKING:
    from .engine import EngineProtocol
    from .plugins import BackendEntry, TransportEntry
    from .weights.manifest import WeightManifest

PROJECT = "rollout_engines"
F = TypeVar("F", bound=Callable[..., Any])

_spec = pluggy.HookspecMarker(PROJECT)
_impl = pluggy.HookimplMarker(PROJECT)


def hookimpl(function: F) -> F:
    """Typed ``@hookimpl`` marker (keeps the decorated signature for type checkers)."""
    return cast(F, _impl(function))


@_spec
def register_backends(register: Callable[[BackendEntry], None]) -> None:
    """Call ``register(BackendEntry(...))`` once per backend this plugin provides."""


@_spec
def register_transports(register: Callable[[TransportEntry], None]) -> None:
    """Call ``register(TransportEntry(...))`` once per weight transport this plugin provides."""


@_spec
def engine_created(engine: EngineProtocol) -> None:
    """An engine was created (after its model loaded)."""


@_spec
def engine_closed(engine: EngineProtocol) -> None:
    """An engine was closed."""


@_spec
def before_weight_update(engine: EngineProtocol, manifest: WeightManifest) -> None:
    """An engine is about to receive the update described by ``manifest``."""


@_spec
def after_weight_update(engine: EngineProtocol, manifest: WeightManifest, seconds: float, error: BaseException | None) -> None:
    """An engine finished receiving an update (``error`` is None on success)."""
