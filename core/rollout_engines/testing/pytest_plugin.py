"""pytest plugin (entry point ``pytest11``): markers, skips and fixtures for every suite that
tests a rollout-engines backend, ours or a third party's.

- One marker per known backend (``transformers``, ``vllm``, ``sglang``, ``remote``, plus any backend a
  plugin registers) and ``gpu``, ``ray``; registered here so ``--strict-markers`` works downstream.
- A test marked with a backend that is not installed is skipped with the install hint as reason;
  ``gpu`` tests skip without CUDA; ``ray`` tests skip without Ray.
- ``--backend NAME`` (repeatable) keeps only tests of those backends (unmarked tests still run).
- Fixtures: ``tiny_model`` (path of the locally built tiny model).
- Nothing process-wide is installed (no signal handler) unless a collected test is marked with a
  backend whose ``BackendEntry.main_thread_setup`` asks for it; that runs once, on the main thread.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import pytest

from ..plugins import FIRST_PARTY, BackendRecord, get_registry

STATIC_MARKERS = {
    "transformers": "needs the embedded transformers backend",
    "vllm": "needs the vLLM backend plugin and vLLM",
    "sglang": "needs the SGLang backend plugin and SGLang",
    "remote": "needs the remote backend plugin (FastAPI server + httpx client)",
    "gpu": "needs a CUDA GPU",
    "ray": "needs Ray",
    "interop": "drives a rollout-engines server with another framework's client or protocol",
}


def _backend_names() -> list[str]:
    names = set(FIRST_PARTY) | {"transformers"}
    names |= {r.name for r in get_registry().records()}
    return sorted(names)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rollout-engines")
    group.addoption(
        "--backend", action="append", default=[], metavar="NAME",
        help="only run tests marked with these backends (unmarked tests still run)",
    )


def pytest_configure(config: pytest.Config) -> None:
    for name, text in STATIC_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    for name in _backend_names():
        if name not in STATIC_MARKERS:
            config.addinivalue_line("markers", f"{name}: needs the '{name}' backend")


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    registry = get_registry()
    records = {r.name: r for r in registry.records()}
    wanted = set(config.getoption("--backend") or [])
    deselected = []
    keep = []
    tested: set[str] = set()
    cuda: bool | None = None
    for item in items:
        marks = {m.name for m in item.iter_markers()}
        backends = marks & set(records)
        if wanted and backends and not backends & wanted:
            deselected.append(item)
            continue
        keep.append(item)
        for name in sorted(backends):
            record = records[name]
            if not record.installed:
                reason = record.error or f"backend '{name}' is not installed: {record.install_hint}"
                item.add_marker(pytest.mark.skip(reason=reason))
                break
        else:
            tested |= backends
        if "gpu" in marks:
            if cuda is None:
                cuda = _cuda_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none visible)"))
        if "ray" in marks and importlib.util.find_spec("ray") is None:
            item.add_marker(pytest.mark.skip(reason='needs Ray: pip install "rollout-engines[ray]"'))
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = keep
    _main_thread_setup(records, tested)


def _main_thread_setup(records: dict[str, BackendRecord], tested: set[str]) -> None:
    """Run the ``main_thread_setup`` of each installed backend that a collected test is marked with
    (here, on the main thread: a harness may create engines on a loop thread, where a signal handler
    cannot be installed). A backend that asks for nothing gets nothing installed in this process."""
    for name in sorted(tested):
        spec = records[name].spec
        if spec is None or spec.main_thread_setup is None:
            continue
        try:
            spec.load_main_thread_setup()()
        except Exception as exc:  # one backend's setup must not stop the others' tests
            warnings.warn(f"main_thread_setup of backend '{name}' ({spec.main_thread_setup}) failed: {exc!r}",
                          stacklevel=1)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Path of the tiny random Qwen2 model (built locally on first use, then cached)."""
    from .tiny_model import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def fp8_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The FP8 tests' model (:func:`rollout_engines.testing.fp8.build_fp8_test_model`), built on the
    GPU once per session."""
    from .fp8 import build_fp8_test_model

    return build_fp8_test_model(tmp_path_factory.mktemp("fp8") / "model")


@pytest.fixture(scope="session")
def fp8_original(fp8_model_dir: Path) -> dict[str, Any]:
    """The FP8 test model's BF16 weights, on the GPU."""
    import torch

    from ..weights.checkpoint import load_checkpoint

    return {k: v.cuda() for k, v in load_checkpoint(fp8_model_dir, dtype=torch.bfloat16).items()}


@pytest.fixture(scope="session")
def fp8_changed(fp8_original: dict[str, Any]) -> dict[str, Any]:
    """:func:`fp8_original`, perturbed (seeded): different weights of the same model."""
    from ..weights.checkpoint import perturbed

    return perturbed(fp8_original, scale=0.5, seed=3)
