"""One sleep-mode vLLM engine per process (vllm#18975): the guard's bookkeeping.

Sleep mode exists only on CUDA, so on a CPU machine the guard is exercised on engine objects that
are not started (test_gpu_vllm.py runs the same rule with real engines on a GPU).
"""

from __future__ import annotations

import pytest
from rollout_engines import EngineConfig
from rollout_engines.engine import Engine

pytestmark = pytest.mark.vllm


def unstarted(model: str):
    from rollout_engines_vllm.engine import VllmEngine

    engine = VllmEngine.__new__(VllmEngine)
    Engine.__init__(engine, EngineConfig(backend="vllm", model=model))
    engine._sleep_registered, engine._engine_loop, engine._llm = False, None, None
    return engine


def test_second_sleep_mode_engine_is_refused_until_the_first_closes(tiny_model):
    from rollout_engines_vllm.engine import SleepModeEngineExists

    first, second = unstarted(str(tiny_model)), unstarted(str(tiny_model))
    first._claim_sleep_mode()
    try:
        with pytest.raises(SleepModeEngineExists, match="one per process") as info:
            second._claim_sleep_mode()
        assert "enable_sleep_mode=False" in str(info.value)
        first._closed = True  # a closed engine no longer holds the allocator
        second._claim_sleep_mode()
    finally:
        for engine in (first, second):
            engine._closed = True
            engine._shutdown_quietly()


def test_cpu_engine_declares_no_sleep_even_when_asked(tiny_model):
    import asyncio

    from rollout_engines import create_engine
    from rollout_engines.errors import CapabilityError

    engine = create_engine("vllm", model=str(tiny_model), enable_sleep_mode=True)
    try:
        if engine.platform == "cuda":
            pytest.skip("sleep is supported on CUDA")
        assert engine.sleep_mode is False and engine.capabilities.sleep_levels == ()
        with pytest.raises(CapabilityError, match="does not support sleep"):
            asyncio.run(engine.sleep())
    finally:
        asyncio.run(engine.close())
