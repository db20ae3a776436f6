"""The async RL example learns while generation runs on, with rollouts that span weight pushes and
a per-token correction from their versions; without pushes it does not learn."""

from __future__ import annotations

import pytest
from repo_scripts import load_script

pytestmark = [pytest.mark.transformers, pytest.mark.timeout(600)]


def load_example():
    return load_script("examples/async_rl.py")


def test_async_rl_learns_with_pushes_and_not_without(tiny_model):
    example = load_example()
    run = example.main(["--model", str(tiny_model), "--json"])
    assert run["reward_first"] < 0.05
    assert run["reward_last"] > 0.6, run["rewards"]
    assert run["pushes"] == run["steps"]
    assert run["completions_spanning_updates"] > 0
    # One-step off-policy: most tokens come from an older version and are importance weighted.
    assert run["lagged_token_fraction"] > 0 and run["is_weight_mean"] is not None and run["max_lag"] >= 1
    assert 0.0 <= run["idle_fraction"] <= 1.0
    control = example.main(["--model", str(tiny_model), "--json", "--no-push", "--steps", "12"])
    assert control["pushes"] == 0 and control["completions_spanning_updates"] == 0
    assert control["reward_last"] < 0.05, control["rewards"]


def test_policy_loss_weights_tokens_by_version_lag():
    import torch

    example = load_example()

    class Uniform(torch.nn.Module):  # logp of every token: -log(4)
        def forward(self, ids):
            return type("Out", (), {"logits": torch.zeros(*ids.shape, 4, requires_grad=True)})()

    logp = -float(torch.log(torch.tensor(4.0)))
    batch = [example.Rollout(0, [1, 2, 3], [logp, logp - 1.0, logp], [5, 4, 1])]
    _, stats = example.policy_loss(Uniform(), [[0, 1]], batch, target=1, version=5, max_lag=2, is_cap=2.0)
    # lag 0 (weight 1), lag 1 (ratio e^1 truncated to 2), lag 4 (dropped)
    assert stats["lagged_tokens"] == 1 and stats["dropped_tokens"] == 1 and stats["truncated"] == 1
    assert stats["is_weight_sum"] == pytest.approx(2.0)
