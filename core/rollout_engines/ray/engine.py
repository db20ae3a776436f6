"""``RayEngine``: an engine of any backend running in a Ray actor, behind the engine API.

    engine = create_ray_engine("transformers", model=path, num_cpus=1, max_restarts=3)
    outs = await engine.generate(request)

The proxy forwards every call to the actor (:class:`~rollout_engines.ray.actor.EngineActor`) and
turns Ray's errors into the library's: an error raised by the engine arrives as itself (a
``ValueError`` stays a ``ValueError``, and so does an engine's start-up failure), a dead,
restarting or unreachable actor, or one that does not answer within ``call_timeout_s``, is
:class:`EngineUnavailable`, so an :class:`~rollout_engines.group.EngineGroup` retries the request on
another engine. With ``max_restarts`` Ray restarts a dead actor (a fresh engine with its initial
weights); a group notices by the weight version and brings it up to date before it takes traffic.
``max_task_retries`` is 0 by default on purpose: a request that was in flight on a dead actor
should be retried by the group on an engine with current weights, not replayed by Ray on the
restarted actor (which has its initial weights).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray.exceptions import ObjectLostError, RayActorError, RayError, RaySystemError, RayTaskError
from ray.util.placement_group import PlacementGroup

from ..envs import RAY_NOSET, RayBundle
from ..errors import EngineUnavailable
from ..group import EngineGroup
from ..options import engine_config
from ..proxy import Channel, ProxyEngine, WireError, bounded
from ..types import EngineConfig, EngineInfo
from .actor import EngineActor
from .placement import bundle_scheduling

logger = logging.getLogger("rollout_engines.ray")

_actor_class: Any = None


def _remote_class() -> Any:
    global _actor_class
    if _actor_class is None:
        _actor_class = ray.remote(EngineActor)
    return _actor_class


def _translate(exc: RayError, label: str) -> BaseException:
    """Ray's error -> the library's: the engine's own error, or EngineUnavailable."""
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, RayError):
            return _translate(cause, label)
        if isinstance(cause, BaseException):
            return cause
    if isinstance(exc, RayActorError | RaySystemError | ObjectLostError):
        return EngineUnavailable(
            f"{label}: its Ray actor is unavailable ({type(exc).__name__}); a group retries on another "
            "engine; a restarted actor rejoins once it is healthy"
        )
    return exc


class RayChannel(Channel):
    """Calls :meth:`EngineActor.call` on the actor; Ray's own failures become :class:`EngineUnavailable`."""

    def __init__(self, actor: Any, label: str, *, kill_on_close: bool = True) -> None:
        self.actor = actor
        self.label = label
        self.kill_on_close = kill_on_close

    async def call(self, method: str, args: dict[str, Any], timeout_s: float | None) -> Any:
        try:
            ok, out = await bounded(self.actor.call.remote(method, args), timeout_s, self.label, method)
        except RayError as exc:
            raise _translate(exc, self.label) from exc
        if not ok:
            raise WireError.model_validate(out).to_exception(self.label)
        return out

    async def aclose(self) -> None:
        if self.kill_on_close:
            ray.kill(self.actor, no_restart=True)


class RayEngine(ProxyEngine):
    """Proxy to an :class:`EngineActor`. Build it with :func:`create_ray_engine`."""

    def __init__(self, actor: Any, config: EngineConfig, described: dict[str, Any], *, kill_on_close: bool = True,
                 call_timeout_s: float | None = 3600.0) -> None:
        self.actor = actor
        self.kill_on_close = kill_on_close
        self._apply_actor(described)
        label = f"ray engine '{described['backend']}' (pid {self.pid})"
        super().__init__(RayChannel(actor, label, kill_on_close=kill_on_close), config, described,
                         call_timeout_s=call_timeout_s)

    def _apply_actor(self, d: dict[str, Any]) -> None:
        self.incarnation: str = d["incarnation"]
        self.node_id: str = d["node_id"]
        self.pid: int = d["pid"]
        self.env: dict[str, str | None] = d["env"]
        if hasattr(self, "channel"):
            self.channel.label = self.label

    @property
    def label(self) -> str:
        return f"ray engine '{self.backend_name}' (pid {self.pid})"

    async def refresh(self) -> dict[str, Any]:
        """Ask the actor again what it hosts (after a restart: new pid and incarnation)."""
        try:
            described: dict[str, Any] = await bounded(self.actor.describe.remote(), self.call_timeout_s,
                                                      self.label, "describe")
        except RayError as exc:
            raise _translate(exc, self.label) from exc
        self._apply(described)
        self._apply_actor(described)
        return described

    async def info(self) -> EngineInfo:
        info = await super().info()
        incarnation = info.extra.get("incarnation")
        if incarnation and incarnation != self.incarnation:
            logger.info("%s was restarted (incarnation %s -> %s)", self.label, self.incarnation, incarnation)
            self.incarnation, self.pid = incarnation, info.extra.get("pid", self.pid)
            self.channel.label = self.label
        return info


def _config_of(backend: str | EngineConfig, model: str | None, kwargs: dict[str, Any]) -> EngineConfig:
    """The engine's config (``model``: a path every Ray node can read)."""
    return engine_config(backend, model, kwargs, caller="create_ray_engine")


def launch_engine_actor(
    config: EngineConfig,
    *,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    placement_group: PlacementGroup | None = None,
    bundle_index: int = 0,
    ray_bundle: RayBundle | dict[str, Any] | None = None,
    max_restarts: int = 0,
    max_task_retries: int = 0,
    max_concurrency: int = 1000,
    runtime_env: dict[str, Any] | None = None,
    actor_options: dict[str, Any] | None = None,
    factory: str | None = None,
) -> Any:
    """Start the actor (returns its handle at once; the model loads in the background).

    ``factory``: optional ``"pkg.module:callable"`` that builds the engine from its config inside
    the actor (default :func:`rollout_engines.create_engine`)."""
    options: dict[str, Any] = {
        "num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": max_restarts,
        "max_task_retries": max_task_retries, "max_concurrency": max_concurrency,
    }
    if placement_group is not None:
        options["scheduling_strategy"] = bundle_scheduling(placement_group, bundle_index)
    env = dict(runtime_env or {})
    bundle_dict = None
    if ray_bundle is not None:
        bundle = ray_bundle if isinstance(ray_bundle, RayBundle) else RayBundle.model_validate(ray_bundle)
        bundle_dict = bundle.model_dump()
        # Ray reads the NOSET switch when it starts the worker process, so it goes in the runtime
        # env; the actor applies the rest (setup_device_env) before the engine library loads.
        env["env_vars"] = {**env.get("env_vars", {}), RAY_NOSET: "1"}
    if env:
        options["runtime_env"] = env
    options.update(actor_options or {})
    return _remote_class().options(**options).remote(config, bundle_dict, factory)


async def _describe(actor: Any, config: EngineConfig, timeout_s: float | None) -> dict[str, Any]:
    """The actor's description once its engine is up; its engine's start-up error as itself."""
    try:
        described: dict[str, Any] = await asyncio.wait_for(actor.describe.remote(), timeout_s)
    except asyncio.TimeoutError:
        raise EngineUnavailable(
            f"the Ray actor for a '{config.backend}' engine did not start within {timeout_s} s; check that the "
            "cluster has the CPUs/GPUs asked for (ray status) and that the model path exists on every node"
        ) from None
    except RayError as exc:
        raise _translate(exc, f"ray engine '{config.backend}'") from exc
    if "start_error" in described:
        raise WireError.model_validate(described["start_error"]).to_exception(f"ray engine '{config.backend}'")
    return described


async def acreate_ray_engines(
    n: int,
    backend: str | EngineConfig = "transformers",
    model: str | None = None,
    *,
    placement_group: PlacementGroup | None = None,
    workers_per_engine: int = 1,
    start_timeout_s: float | None = 600.0,
    call_timeout_s: float | None = 3600.0,
    kill_on_close: bool = True,
    **kwargs: Any,
) -> list[RayEngine]:
    """Start ``n`` engine actors at once (models load in parallel) and wait until all are ready.

    ``start_timeout_s`` bounds start-up (model load); ``call_timeout_s`` bounds every other call
    (weight calls and ``health`` have their own bounds, see :class:`ProxyEngine`); past it the call
    raises :class:`EngineUnavailable`. An engine that fails to start raises its own error and no
    actor is left. With ``placement_group``, engine ``i`` is placed on bundle
    ``i * workers_per_engine``. Other keyword arguments are :func:`launch_engine_actor`'s options or
    engine settings, as in :func:`create_ray_engine`.
    """
    launch_keys = {"num_cpus", "num_gpus", "ray_bundle", "max_restarts", "max_task_retries",
                   "max_concurrency", "runtime_env", "actor_options", "bundle_index", "factory"}
    launch = {k: kwargs.pop(k) for k in list(kwargs) if k in launch_keys}
    first_bundle = launch.pop("bundle_index", 0)
    config = _config_of(backend, model, kwargs)
    actors = [
        launch_engine_actor(config, placement_group=placement_group, bundle_index=first_bundle + i * workers_per_engine, **launch)
        for i in range(n)
    ]
    results = await asyncio.gather(*(_describe(a, config, start_timeout_s) for a in actors), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for a in actors:
            ray.kill(a, no_restart=True)
        raise errors[0]
    return [RayEngine(a, config, d, kill_on_close=kill_on_close, call_timeout_s=call_timeout_s)  # type: ignore[arg-type]
            for a, d in zip(actors, results, strict=True)]


def create_ray_engine(backend: str | EngineConfig = "transformers", model: str | None = None, **kwargs: Any) -> RayEngine:
    """Start one engine of ``backend`` in a Ray actor and return its proxy once the model is loaded.

    Actor options: ``num_cpus``, ``num_gpus`` (fractional to share a GPU with a trainer worker),
    ``placement_group`` + ``bundle_index``, ``ray_bundle`` (:class:`rollout_engines.envs.RayBundle`,
    for engines that start their own workers), ``max_restarts``, ``max_task_retries``,
    ``runtime_env``, ``actor_options`` (any other ``ActorClass.options``); ``start_timeout_s`` and
    ``call_timeout_s`` as for :func:`acreate_ray_engines`. Everything else is the
    engine's configuration, as for :func:`rollout_engines.create_engine`. Call it outside a running
    event loop (use :func:`acreate_ray_engines` inside one).
    """
    return asyncio.run(acreate_ray_engines(1, backend, model, **kwargs))[0]


async def acreate_ray_group(
    n: int,
    backend: str | EngineConfig = "transformers",
    model: str | None = None,
    *,
    group_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> EngineGroup:
    """``n`` Ray engines (see :func:`acreate_ray_engines`) behind one :class:`EngineGroup`
    (``group_options`` are its keyword arguments: routing, backpressure, health checks, rejoin)."""
    engines = await acreate_ray_engines(n, backend, model, **kwargs)
    return EngineGroup(engines, **(group_options or {}))
