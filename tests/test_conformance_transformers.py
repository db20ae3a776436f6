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


def test_overriding_a_standard_test_needs_an_xfail_reason() -> None:
    with pytest.raises(TypeError, match="overrides a standard conformance test"):

        class Quiet(BackendConformance):  # noqa: F841 - defining it is the test
            def test_chat(self, slot, engine, tokenizer):
                pass

    class Declared(BackendConformance):
        @pytest.mark.xfail(reason="this backend has no chat template support yet")
        def test_chat(self, slot, engine, tokenizer):
            raise NotImplementedError

    assert Declared.test_chat.pytestmark[0].kwargs["reason"]
