"""Plugin discovery, isolation, precedence and the exact messages users see.

Plugins come from committed fake ``*.dist-info`` folders put on ``sys.path`` (no pip install)."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
from pathlib import Path

import pytest
import rollout_engines as roe
from rollout_engines.plugins import ENTRY_POINT_GROUP, Registry, first_party_hint, reset_registry

FIXTURES = Path(__file__).parent / "plugin_fixtures"


@pytest.fixture
def plugin_env(monkeypatch: pytest.MonkeyPatch):
    """Returns a loader: put the named fixture plugins on sys.path and build a fresh registry."""
    for var in ("ROLLOUT_ENGINES_PLUGINS_DENY", "ROLLOUT_ENGINES_PLUGINS_ALLOW", "ROLLOUT_ENGINES_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)

    def load(*names: str, **env: str) -> Registry:
        for name in names:
            monkeypatch.syspath_prepend(str(FIXTURES / name))
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        registry = Registry()
        registry.load_entry_points(md.entry_points(group=ENTRY_POINT_GROUP))
        reset_registry(registry)
        return registry

    yield load
    reset_registry(None)
    for mod in [m for m in sys.modules if m.startswith("roe_")]:
        del sys.modules[mod]


def test_core_registers_transformers_and_transports(plugin_env) -> None:
    registry = plugin_env()
    record = registry.backends["transformers"]
    assert record.distribution == "rollout-engines" and record.installed
    assert {"inproc", "gloo", "nccl", "shm", "cuda_ipc", "disk"} <= set(registry.transports)


def test_broken_plugin_is_reported_and_skipped(plugin_env) -> None:
    registry = plugin_env("broken", "good")
    assert [(f.entry_point, f.distribution, f.error) for f in registry.failures] == [
        ("brokenplug", "roe_brokenplug", "RuntimeError: boom: this plugin is broken on purpose")
    ]
    assert registry.backends["good"].installed  # the others keep working
    assert registry.backends["transformers"].installed


def test_strict_mode_reraises_broken_plugin(plugin_env) -> None:
    with pytest.raises(RuntimeError, match="boom: this plugin is broken on purpose"):
        plugin_env("broken", ROLLOUT_ENGINES_STRICT_PLUGINS="1")


def test_hookimpl_matching_no_spec_is_rejected(plugin_env) -> None:
    registry = plugin_env("badhook")
    (failure,) = registry.failures
    assert failure.entry_point == "badhook"
    assert "unknown hook 'register_backend'" in failure.error


def test_duplicate_name_is_an_error_naming_both_distributions(plugin_env) -> None:
    plugin_env("good", "dup")
    with pytest.raises(roe.DuplicateBackend) as info:
        roe.create_engine("good", model="unused")
    assert str(info.value) == (
        "backend 'good' is registered by two distributions: 'roe_dupplug' and 'roe_goodplug'. "
        "Uninstall one, or block one with ROLLOUT_ENGINES_PLUGINS_DENY."
    )


def test_strict_mode_raises_duplicate_at_discovery(plugin_env) -> None:
    with pytest.raises(roe.DuplicateBackend, match="'roe_dupplug' and 'roe_goodplug'"):
        plugin_env("good", "dup", ROLLOUT_ENGINES_STRICT_PLUGINS="1")


def test_deny_list_blocks_by_distribution_name(plugin_env) -> None:
    registry = plugin_env("good", "dup", ROLLOUT_ENGINES_PLUGINS_DENY="roe_dupplug")
    assert registry.backends["good"].distribution == "roe_goodplug"
    assert registry.backends["good"].error is None
    assert "dupplug" in registry.blocked


def test_two_distributions_with_one_entry_point_name_are_both_loaded(plugin_env) -> None:
    """roe_goodplug and roe_samename both name their entry point 'goodplug': the second is not
    skipped as "already loaded", so its own backend appears and the clash on 'good' is rule 4's error."""
    registry = plugin_env("good", "samename")
    assert registry.backends["samename"].distribution == "roe_samename"
    with pytest.raises(roe.DuplicateBackend, match="'roe_goodplug' and 'roe_samename'"):
        roe.create_engine("good", model="unused")


def test_deny_by_distribution_blocks_only_that_distribution(plugin_env) -> None:
    registry = plugin_env("good", "samename", ROLLOUT_ENGINES_PLUGINS_DENY="roe_samename")
    assert "samename" not in registry.backends
    assert registry.backends["good"].distribution == "roe_goodplug"
    assert registry.backends["good"].error is None


def test_allow_list_loads_only_named_plugins_and_the_core(plugin_env) -> None:
    registry = plugin_env("good", "broken", "dup", ROLLOUT_ENGINES_PLUGINS_ALLOW="goodplug")
    # Every plugin not on the list is blocked (other installed plugins too), the named one is not.
    assert {"brokenplug", "dupplug"} <= set(registry.blocked)
    assert "goodplug" not in registry.blocked and "core" not in registry.blocked
    assert registry.failures == []
    assert registry.backends["good"].error is None
    assert "transformers" in registry.backends  # the core's own entry point is implicitly allowed


def test_allow_list_exempts_only_the_cores_own_entry_point(plugin_env) -> None:
    """A third party's entry point named 'core' is not the core's: the allow list blocks it."""
    registry = plugin_env("good", "fakecore", ROLLOUT_ENGINES_PLUGINS_ALLOW="goodplug")
    assert "fakecore" not in registry.backends
    assert "transformers" in registry.backends and "good" in registry.backends


def test_deny_wins_over_allow(plugin_env) -> None:
    registry = plugin_env("good", ROLLOUT_ENGINES_PLUGINS_ALLOW="goodplug", ROLLOUT_ENGINES_PLUGINS_DENY="goodplug")
    assert "good" not in registry.backends
    assert "goodplug" in registry.blocked


def test_deny_can_block_the_core(plugin_env) -> None:
    registry = plugin_env(ROLLOUT_ENGINES_PLUGINS_DENY="core")
    assert "transformers" not in registry.backends


def test_unknown_backend_message(plugin_env) -> None:
    registry = plugin_env()
    installed = ", ".join(r.name for r in registry.records() if r.installed)
    known = ", ".join(r.name for r in registry.records())
    assert "transformers" in installed and {"vllm", "sglang", "remote"} <= set(known.split(", "))
    with pytest.raises(roe.UnknownBackend) as info:
        roe.create_engine("transformer", model="unused")
    assert str(info.value) == (
        f"unknown backend 'transformer'. Did you mean 'transformers'? Installed: {installed}; "
        f"known: {known}. Run `rollout-engines backends` to list them."
    )


def test_first_party_backend_not_installed_gives_pip_line(plugin_env) -> None:
    registry = plugin_env()
    if "sglang" in registry.backends and registry.backends["sglang"].installed:
        pytest.skip("sglang is installed here")
    with pytest.raises(roe.BackendNotInstalled) as info:
        roe.create_engine("sglang", model="unused")
    message = str(info.value)
    assert message.startswith("backend 'sglang' is not installed. Install it with: ")
    assert first_party_hint("sglang") in message


def test_plugin_installed_but_library_missing(plugin_env) -> None:
    registry = plugin_env("good")
    assert registry.backends["needslib"].installed is False
    with pytest.raises(roe.BackendNotInstalled) as info:
        roe.create_engine("needslib", model="unused")
    assert str(info.value) == (
        "backend 'needslib' is not installed. Install it with: pip install \"roe-goodplug[needslib]\" "
        "(import failed: no module named 'definitely_not_installed_lib')"
    )


def test_registration_is_idempotent(plugin_env) -> None:
    registry = plugin_env("good")
    registry.load_entry_points(md.entry_points(group=ENTRY_POINT_GROUP))  # as in a worker process
    assert registry.failures == []
    assert registry.backends["good"].error is None


def test_unknown_transport_message(plugin_env) -> None:
    registry = plugin_env()
    with pytest.raises(roe.UnknownTransport) as info:
        registry.transport("glooo")
    known = ", ".join(sorted(registry.transports))
    assert str(info.value) == f"unknown weight transport 'glooo'. Did you mean 'gloo'? Known: {known}."


def test_backends_cli_is_fast_and_imports_no_engine_library() -> None:
    """`rollout-engines backends --json` imports neither torch nor any engine/server library."""
    code = (
        "import json, sys, time\n"
        "t = time.perf_counter()\n"
        "from rollout_engines.cli import main\n"
        "main(['backends', '--json'])\n"
        "heavy = [m for m in ('torch', 'vllm', 'sglang', 'ray', 'fastapi', 'transformers', 'httpx') if m in sys.modules]\n"
        "print(json.dumps({'heavy': heavy, 'seconds': time.perf_counter() - t}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    rows, probe = json.loads(lines[0]), json.loads(lines[-1])
    assert probe["heavy"] == []
    by_name = {r["name"]: r for r in rows}
    assert by_name["transformers"]["installed"] is True
    assert set(by_name["transformers"]) == {
        "name", "installed", "distribution", "version", "capabilities", "install_hint", "error"
    }
    assert probe["seconds"] < 1.0


def test_import_is_light() -> None:
    code = "import sys, rollout_engines; print([m for m in ('torch', 'vllm', 'ray', 'fastapi') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_listed_capabilities_agree_with_the_engine_class() -> None:
    """A backend's registration lists some capabilities without importing its engine (for
    ``rollout-engines backends``); each must be what the engine class declares (lists: everything
    the class declares and what other devices add, e.g. CUDA transports), so the listing cannot
    drift from the engine."""
    from rollout_engines.plugins import get_registry
    from rollout_engines.proxy import ProxyEngine

    registry = get_registry()
    checked = 0
    for record in registry.records():
        if record.spec is None or not record.installed or record.duplicate_of:
            continue
        try:
            cls = registry.load_backend(record.name)
        except roe.errors.BackendNotInstalled:
            continue  # its engine library is not in this environment
        if issubclass(cls, ProxyEngine):
            continue  # a proxy declares what the engine it reaches declares, known once connected
        declared = cls.capabilities.model_dump(mode="json")
        for key, value in record.spec.capabilities.items():
            assert key in declared, f"{record.name}: lists unknown capability '{key}'"
            if isinstance(value, (list, tuple)):  # the listing names every device's (a superset)
                assert set(declared[key]) <= set(value), (
                    f"{record.name}: lists {key}={value!r}; its engine class declares {declared[key]!r} too"
                )
            else:
                assert declared[key] == value, (
                    f"{record.name}: lists {key}={value!r}, its engine class declares {declared[key]!r}"
                )
        checked += 1
    assert checked >= 1  # the built-in transformers backend at least
