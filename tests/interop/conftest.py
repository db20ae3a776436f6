"""What the interop tests share: rollout-engines servers on the tiny model, in this process."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


def _remote_test_servers() -> Any:
    """The remote plugin's test servers (``plugins/remote/tests/conftest.py``), loaded by path."""
    name = "_roe_remote_test_servers"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "plugins" / "remote" / "tests" / "conftest.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def start_server(tiny_model: Path) -> Iterator[Callable[..., Any]]:
    """``start_server(**options)``: serve a transformers engine on the tiny model from a thread of
    this process (options as ``start_thread_server`` takes them); stopped when the module ends."""
    import rollout_engines as roe

    started: list[Any] = []

    def start(**options: Any) -> Any:
        engine = roe.create_engine("transformers", model=str(tiny_model))
        started.append(_remote_test_servers().start_thread_server(engine, **options))
        return started[-1]

    yield start
    for server in started:
        server.stop()
