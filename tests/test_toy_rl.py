"""The toy RL example learns only when its weight pushes reach the engine."""

from __future__ import annotations

import pytest
from repo_scripts import load_script

pytestmark = [pytest.mark.transformers, pytest.mark.timeout(300)]


def load_example():
    return load_script("examples/toy_rl.py")


@pytest.mark.parametrize("transport", ["shm"])  # the engine runs in its own process
def test_reward_rises_with_push_and_not_without(tiny_model, transport):
    toy = load_example()
    common = ["--model", str(tiny_model), "--transport", transport, "--steps", "13", "--json"]
    learned = toy.main(common)
    assert learned["first_reward"] < 0.05
    assert learned["last_reward"] > 0.8, learned["rewards"]
    control = toy.main([*common, "--no-push"])
    assert control["last_reward"] < 0.05, control["rewards"]


def test_delta_pushes_send_under_a_third_of_the_bytes_and_still_learn(tiny_model):
    toy = load_example()
    run = toy.main(["--model", str(tiny_model), "--transport", "gloo", "--steps", "13", "--json",
                    "--delta", "--freeze-embeddings"])
    assert run["last_reward"] > 0.5, run["rewards"]
    assert run["bytes_sent"][0] >= run["full_bytes_per_step"]  # the first push is full
    assert run["bytes_ratio"] <= 0.3, run
    assert max(run["bytes_sent"][1:]) <= 0.3 * run["full_bytes_per_step"]
