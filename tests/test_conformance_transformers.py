"""The embedded `transformers` backend against the conformance suite."""

import pytest
from rollout_engines import EngineConfig
from rollout_engines.testing.conformance import BackendConformance


@pytest.mark.transformers
class TestTransformersConformance(BackendConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def engine_config(cls, tiny_model):
        return EngineConfig(backend="transformers", model=str(tiny_model), dtype="float32")


@pytest.mark.transformers
@pytest.mark.gpu
class TestTransformersConformanceCuda(BackendConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def engine_config(cls, tiny_model):
        return EngineConfig(backend="transformers", model=str(tiny_model), dtype="float32", device="cuda")
