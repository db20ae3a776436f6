"""lm-eval's ``local-completions`` model (lm-eval 0.4.13) against ``rollout-engines serve --backend
transformers``: a small local multiple-choice (log-likelihood) task runs to a score.

Log-likelihood requests are ``/v1/completions`` with token-id prompts, ``echo: true``,
``logprobs: 1``, ``max_tokens: 1``, ``temperature: 0``; lm-eval sums the prompt's token logprobs
after the context and checks greediness against ``top_logprobs``. The task and its data are local
files (no hub access); lm-eval tokenizes with the tiny model's own tokenizer. It sends the API key
from ``$OPENAI_API_KEY``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.interop, pytest.mark.transformers, pytest.mark.remote]

lm_eval = pytest.importorskip("lm_eval", reason="needs lm-eval (nox -s interop)")

QUESTIONS = [
    ("The sky is", ["blue", "a sandwich", "seven"], 0),
    ("Two plus two is", ["four", "green", "a river"], 0),
    ("Water is", ["wet", "loud", "a Tuesday"], 0),
    ("The sun rises in the", ["east", "fridge", "piano"], 0),
    ("Cats like to", ["sleep", "orbit", "compile"], 0),
    ("Fire is", ["hot", "square", "silent"], 0),
]

TASK_YAML = """\
task: roe_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from rollout_engines_remote.launch import ServerProcess

    log = tmp_path_factory.mktemp("lm_eval") / "server.log"
    with ServerProcess("transformers", str(tiny_model), log=log,
                       extra_args=["--protocols", "openai", "--served-model-name", "tiny"]) as s:
        yield s


@pytest.fixture
def task_dir(tmp_path: Path) -> Path:
    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "label": label}) + "\n"
                            for q, c, label in QUESTIONS))
    (tmp_path / "roe_tiny_mc.yaml").write_text(TASK_YAML.format(data=data))
    return tmp_path


def test_local_completions_loglikelihood_task_scores(server: Any, tiny_model: Path, task_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", server.api_key)
    model_args = ",".join([
        "model=tiny", f"base_url={server.url}/v1/completions", f"tokenizer={tiny_model}",
        "tokenizer_backend=huggingface", "num_concurrent=1", "max_retries=1", "timeout=120",
    ])
    results = lm_eval.simple_evaluate(
        model="local-completions", model_args=model_args, tasks=["roe_tiny_mc"],
        task_manager=TaskManager(include_path=str(task_dir)), batch_size=1, log_samples=True,
    )
    assert results is not None
    metrics = results["results"]["roe_tiny_mc"]
    acc = metrics["acc,none"]
    print(f"lm-eval {lm_eval.__version__} roe_tiny_mc: acc={acc:.3f} over {len(QUESTIONS)} questions")
    assert 0.0 <= acc <= 1.0
    samples = results["samples"]["roe_tiny_mc"]
    assert len(samples) == len(QUESTIONS)
    for s in samples:  # every choice scored: a finite, negative log-likelihood from the server
        lls = [resp[0][0] for resp in s["resps"]]
        assert len(lls) == 3 and all(math.isfinite(x) and x < 0 for x in lls)
