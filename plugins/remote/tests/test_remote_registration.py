"""Registration is metadata only: listing backends and transports imports neither FastAPI nor httpx."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.remote


def test_registering_imports_no_http_stack():
    code = (
        "import json, sys\n"
        "import rollout_engines as roe\n"
        "r = roe.get_registry()\n"
        "spec = r.backend('remote')\n"
        "t = r.transport('http')\n"
        "print(json.dumps({'target': spec.target, 'requires': list(spec.requires), 'sender': t.sender,\n"
        "  'loaded': sorted(m for m in ('fastapi', 'httpx', 'uvicorn', 'starlette', 'torch', 'prometheus_client')\n"
        "                  if m in sys.modules)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["target"] == "rollout_engines_remote.client:RemoteEngine"
    assert info["requires"] == ["httpx"]
    assert info["sender"] == "rollout_engines_remote.transport:HttpSender"
    assert info["loaded"] == []


def test_remote_is_listed_installed():
    import rollout_engines as roe

    record = next(r for r in roe.get_registry().records() if r.name == "remote")
    assert record.installed and record.distribution == "rollout-engines-remote"
    assert "http" in record.as_dict()["capabilities"]["transports"]
