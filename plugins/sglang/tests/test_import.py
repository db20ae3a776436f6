"""Without SGLang (and without a GPU) the plugin imports, registers and reports its capabilities;
creating an engine says exactly what to install."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from rollout_engines import create_engine, get_registry
from rollout_engines.errors import BackendNotInstalled
from rollout_engines.plugins import first_party_hint

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")


def test_registration_imports_neither_sglang_nor_torch() -> None:
    code = (
        "import sys, rollout_engines_sglang, rollout_engines_sglang.plugin as p\n"
        "from rollout_engines import get_registry\n"
        "rec = {r.name: r for r in get_registry().records()}['sglang']\n"
        "print(rec.spec.target, rec.installed, rec.spec.capabilities['weights_kept_on_sleep'])\n"
        "print('sglang' in sys.modules, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    lines = out.stdout.split("\n")
    assert lines[0] == "rollout_engines_sglang.engine:SglangEngine False False"
    assert lines[1] == "False False"


def test_capabilities_and_transport_are_listed() -> None:
    registry = get_registry()
    spec = {r.name: r for r in registry.records()}["sglang"].spec
    assert spec.requires == ("sglang",)
    assert spec.install_hint == first_party_hint("sglang")
    assert spec.capabilities["sleep_tags"] == ["weights", "kv_cache"]
    entry = registry.transport("sglang_nccl")
    assert entry.sender == "rollout_engines_sglang.transport:SglangNcclSender"


def test_create_engine_without_sglang_names_the_pip_line(tiny_model) -> None:
    with pytest.raises(BackendNotInstalled) as info:
        create_engine("sglang", model=str(tiny_model))
    assert first_party_hint("sglang") in str(info.value)
    assert "sglang" in str(info.value)


def test_engine_module_imports_without_sglang() -> None:
    from rollout_engines_sglang.engine import SglangEngine, server_kwargs

    assert SglangEngine.backend_name == "sglang"
    assert "sglang" not in sys.modules
    assert callable(server_kwargs)
