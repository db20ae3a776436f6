"""The example third-party backend passes the same conformance suite as the first-party ones.

It is found through its entry point (installed with ``pip install -e examples/third_party_plugin``);
its marker ``hfgenerate`` is registered by the core's pytest plugin from the registry."""

import pytest
from rollout_engines import EngineConfig, get_registry
from rollout_engines.testing.conformance import BackendConformance


def test_found_through_its_entry_point() -> None:
    record = get_registry().backends["hfgenerate"]
    assert record.distribution == "rollout-engines-hfgenerate" and record.installed


@pytest.mark.hfgenerate
class TestHFGenerateConformance(BackendConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def engine_config(cls, tiny_model):
        return EngineConfig(backend="hfgenerate", model=str(tiny_model), dtype="float32")
