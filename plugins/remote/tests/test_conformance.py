"""The core conformance suite through the ``remote`` backend, against a real ``rollout-engines
serve`` child process running the ``transformers`` backend on the tiny model.

Two passes: weights over ``http`` (the remote-only transport), and over ``gloo`` set up through
the server's control plane (the trainer broadcasts straight to the server's engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_engines.testing.conformance import BackendConformance
from rollout_engines.types import EngineConfig

from .conftest import API_KEY


class _RemoteBase(BackendConformance):
    transports: tuple[str, ...] = ()

    @pytest.fixture(scope="class")
    @classmethod
    def engine_config(cls, served) -> EngineConfig:
        return EngineConfig(backend="remote", model=served.url,
                            options={"api_key": API_KEY, "transports": list(cls.transports)})

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, tiny_model: Path) -> str:
        # The engine's model is the server's URL; the suite reads tokenizer and weights from disk.
        return str(tiny_model)


@pytest.mark.remote
class TestRemoteOverHttp(_RemoteBase):
    transports = ("http",)


@pytest.mark.remote
class TestRemoteOverGloo(_RemoteBase):
    transports = ("gloo",)
