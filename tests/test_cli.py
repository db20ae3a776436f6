"""The ``rollout-engines`` command's own rules: every option a subcommand accepts reaches the code
that runs it, or is a usage error (exit 2) that says why. The engines are stubbed here; the demo
itself runs end to end in ``tests/group`` and ``tests/ray``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from rollout_engines import demo_group
from rollout_engines.cli import main

SUMMARY = {"backend": "transformers", "outputs_changed": True, "same_after_wake": True, "weight_version": 1}


@pytest.fixture
def group_demo(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Stubs ``run_group_demo``; returns the list its calls' arguments are appended to."""
    calls: list[dict[str, Any]] = []

    def run_group_demo(backend: str, model: str | None, engines: int, use_ray: bool, **kwargs: Any) -> dict[str, Any]:
        calls.append({"backend": backend, "model": model, "engines": engines, "use_ray": use_ray, **kwargs})
        return dict(SUMMARY)

    monkeypatch.setattr(demo_group, "run_group_demo", run_group_demo)
    return calls


def test_group_demo_gets_max_tokens_and_says_its_progress(group_demo, capsys) -> None:
    assert main(["demo", "--engines", "2", "--max-tokens", "3", "--json"]) == 0
    (call,) = group_demo
    assert call["engines"] == 2 and call["max_tokens"] == 3
    assert callable(call.get("say"))  # progress lines go to stderr in --json mode, as for one engine
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == SUMMARY


@pytest.mark.parametrize("argv, message", [
    (["--engines", "0"], "--engines must be >= 1"),
    (["--engines", "-1"], "--engines must be >= 1"),
    (["--engines", "2", "--transport", "shm"], "--transport applies to one engine"),
    (["--ray", "--transport", "shm"], "--transport applies to one engine"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
])
def test_demo_options_it_cannot_honour_are_usage_errors(group_demo, capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["demo", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert group_demo == []  # nothing ran
