"""The ``remote`` backend driving a plain SGLang server (``options["server"] = "sglang"``).

SGLang cannot run on this CPU-only machine, so the server here is ``FakeSglangServer``: a real
HTTP server (FastAPI + uvicorn on 127.0.0.1) that implements just the shape of SGLang's native
HTTP API and records every request. It is a fake, and says so: it checks what the adapter sends
and parses what SGLang would answer, not SGLang's model execution. Its "model" is arithmetic:
output token k of a prompt is ``(sum(prompt) + k + shift) % vocab``, where ``shift`` changes with
every weight update it loads, so a push that arrives changes the outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import rollout_engines as roe
from fastapi import Request  # module level: FastAPI resolves the handlers' annotations here

from .app_thread import AppThread

pytestmark = pytest.mark.remote

pytest.importorskip("rollout_engines_sglang", reason="the sglang adapter reuses rollout-engines-sglang")


class FakeSglangServer(AppThread):
    """SGLang's HTTP API shape on a real uvicorn server (see the module docstring)."""

    def __init__(self, model_path: str, *, vocab: int = 4096, tp_size: int = 1) -> None:
        from fastapi import FastAPI

        self.model_path, self.vocab, self.tp_size = model_path, vocab, tp_size
        self.calls: list[tuple[str, Any]] = []
        self.shift = 0
        self.released: set[str] = set()
        self.paused = False
        app = FastAPI()

        async def record(request: Request) -> Any:
            body = await request.json() if await request.body() else None
            self.calls.append((request.url.path, body))
            return body

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {}

        @app.get("/get_model_info")
        async def model_info() -> dict[str, Any]:
            return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                    "weight_version": "default"}

        @app.get("/get_server_info")
        async def server_info() -> dict[str, Any]:
            return {"tp_size": self.tp_size, "context_length": 2048, "version": "0.5.17"}

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            body = await record(request)
            if body["input_ids"] and body["input_ids"][0] == [4095, 4095]:
                # SGLang's answer to a request it rejects: HTTP 400 with an OpenAI-style error.
                from fastapi.responses import JSONResponse

                return JSONResponse({"error": {"message": "The input is too long"}}, status_code=400)
            outs = []
            for ids, sp in zip(body["input_ids"], body["sampling_params"], strict=True):
                n = sp["max_new_tokens"]
                tokens = [(sum(ids) + k + self.shift) % self.vocab for k in range(n)]
                meta: dict[str, Any] = {"id": f"r{len(outs)}", "prompt_tokens": len(ids),
                                        "completion_tokens": n, "finish_reason": {"type": "length", "length": n}}
                if body.get("return_logprob"):
                    meta["output_token_logprobs"] = [[-0.25 * (k + 1), t, None] for k, t in enumerate(tokens)]
                outs.append({"text": "", "output_ids": tokens, "meta_info": meta})
            return outs

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache(request: Request) -> dict[str, Any]:
            await record(request)
            return {}

        @app.post("/pause_generation")
        async def pause(request: Request) -> dict[str, Any]:
            await record(request)
            self.paused = True
            return {}

        @app.post("/continue_generation")
        async def resume(request: Request) -> dict[str, Any]:
            await record(request)
            self.paused = False
            return {}

        @app.post("/release_memory_occupation")
        async def release(request: Request) -> dict[str, Any]:
            body = await record(request)
            self.released |= set(body["tags"])
            return {"success": True, "message": ""}

        @app.post("/resume_memory_occupation")
        async def resume_memory(request: Request) -> dict[str, Any]:
            body = await record(request)
            self.released -= set(body["tags"])
            return {"success": True, "message": ""}

        @app.post("/update_weights_from_disk")
        async def from_disk(request: Request) -> dict[str, Any]:
            body = await record(request)
            files = sorted(p.name for p in Path(body["model_path"]).glob("*.safetensors"))
            if not files:
                return {"success": False, "message": f"no safetensors in {body['model_path']}"}
            self.shift += 1
            return {"success": True, "message": "Succeeded to update model weights."}

        @app.post("/init_weights_update_group")
        async def init_group(request: Request) -> dict[str, Any]:
            await record(request)
            return {"success": True, "message": ""}

        @app.post("/update_weights_from_distributed")
        async def from_distributed(request: Request) -> dict[str, Any]:
            await record(request)
            return {"success": True, "message": ""}

        super().__init__(app)

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls]


@pytest.fixture
def fake(tiny_model):
    server = FakeSglangServer(str(tiny_model))
    yield server
    server.stop()


@pytest.fixture
async def engine(fake):
    e = roe.create_engine("remote", model=fake.url, server="sglang")
    yield e
    await e.close()


def test_capabilities_declare_what_sglang_does_over_http(engine):
    caps = engine.capabilities
    assert set(caps.transports) == {"sglang_nccl", "disk"}
    assert caps.sleep_levels == (1,) and set(caps.sleep_tags) == {"weights", "kv_cache"}
    assert caps.weights_kept_on_sleep is False  # SGLang releases weights: a push must follow
    assert caps.seed is False and caps.pause and caps.prefix_cache and caps.multi_process
    with pytest.raises(roe.CapabilityError, match="cannot receive weights over 'gloo'"):
        import asyncio

        asyncio.run(engine.init_weight_transfer(roe.TransportSpec(transport="gloo", session_id="s")))


async def test_generate_translates_requests_and_outputs(engine, fake):
    prompts = [[5, 6, 7], [100]]
    sampling = roe.SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, max_tokens=4, n=2,
                                  stop=["\n\n"], stop_token_ids=[2], ignore_eos=True, logprobs=1)
    outs = await engine.generate(roe.GenerateRequest(prompt_token_ids=prompts, sampling=sampling))
    path, body = fake.calls[-1]
    assert path == "/generate"
    # n is expanded prompt-major, one sample per entry; SGLang's names for the fields.
    assert body["input_ids"] == [[5, 6, 7], [5, 6, 7], [100], [100]]
    sp = body["sampling_params"][0]
    assert sp["max_new_tokens"] == 4 and sp["n"] == 1 and sp["top_k"] == 20 and sp["min_p"] == 0.05
    assert sp["stop"] == ["\n\n"] and sp["ignore_eos"] is True
    # With ignore_eos SGLang skips its stop-token check, so the plugin cuts at stop_token_ids itself.
    assert "stop_token_ids" not in sp
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1
    assert [(c.prompt_index, c.sample_index) for c in outs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert outs[0].token_ids == [18, 19, 20, 21] and outs[0].prompt_token_ids == [5, 6, 7]
    assert outs[0].logprobs == [-0.25, -0.5, -0.75, -1.0]
    assert all(c.finish_reason == "length" and c.weight_version == 0 for c in outs)
    with pytest.raises(roe.CapabilityError, match="seed"):
        await engine.generate(roe.GenerateRequest(prompt_token_ids=prompts,
                                                  sampling=roe.SamplingParams(seed=1)))


async def test_text_prompts_are_tokenized_on_the_client(engine, fake, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    await engine.generate(roe.GenerateRequest(prompts=["hello world"], sampling=roe.SamplingParams(max_tokens=2)))
    assert fake.calls[-1][1]["input_ids"] == [tok("hello world")["input_ids"]]


async def test_sleep_wake_pause_and_cache_map_to_sglang_endpoints(engine, fake):
    prompts = roe.GenerateRequest(prompt_token_ids=[[1, 2]], sampling=roe.SamplingParams(max_tokens=2))
    await engine.pause()
    assert fake.calls[-1] == ("/pause_generation", {"mode": "in_place"}) and fake.paused
    await engine.resume()
    assert fake.calls[-1][0] == "/continue_generation" and not fake.paused
    await engine.reset_prefix_cache()
    assert fake.calls[-1][0] == "/flush_cache"
    await engine.sleep(tags=["kv_cache"])
    assert fake.calls[-1] == ("/release_memory_occupation", {"tags": ["kv_cache"]})
    await engine.wake_up(tags=["kv_cache"])
    assert fake.calls[-2] == ("/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert fake.calls[-1][0] == "/flush_cache"  # stale prefix cache dropped after wake-up
    assert len(await engine.generate(prompts)) == 1
    # Released weights come back as memory, not values: generation is refused until a push.
    await engine.sleep()
    assert set(fake.calls[-1][1]["tags"]) == {"weights", "kv_cache"}
    await engine.wake_up()
    with pytest.raises(roe.WeightsInvalidated, match="push"):
        await engine.generate(prompts)
    assert fake.paths().count("/generate") == 1  # the refusal happened before SGLang was asked


async def test_disk_push_reaches_the_server_and_changes_outputs(engine, fake, tiny_model, tmp_path):
    from rollout_engines.weights.checkpoint import load_checkpoint, perturbed

    request = roe.GenerateRequest(prompt_token_ids=[[3, 4]], sampling=roe.SamplingParams(max_tokens=3))
    before = (await engine.generate(request))[0].token_ids
    await engine.sleep()
    await engine.wake_up()
    sync = await roe.connect_weight_sync([engine], transport="disk", options={"path": str(tmp_path)})
    try:
        weights = perturbed(load_checkpoint(str(tiny_model)))
        assert await sync.push(weights, version=3) == 3
        path, body = next(c for c in reversed(fake.calls) if c[0] == "/update_weights_from_disk")
        assert Path(body["model_path"]).is_dir() and body["flush_cache"] is False
        after = await engine.generate(request)
        assert after[0].token_ids != before and after[0].weight_version == 3
        # A manifest that does not fit the checkpoint is refused before SGLang reads anything.
        bad = dict(weights)
        bad["model.not_a_layer.weight"] = bad[next(iter(bad))]
        loads = fake.paths().count("/update_weights_from_disk")
        with pytest.raises(roe.WeightSyncError, match="not_a_layer"):
            await sync.push(bad, version=4)
        assert fake.paths().count("/update_weights_from_disk") == loads
        assert engine.weight_version == 3
    finally:
        await sync.close()


async def test_server_errors_become_typed_errors(engine, fake):
    from rollout_engines_remote.protocol import RemoteRequestInvalid

    with pytest.raises(RemoteRequestInvalid, match="The input is too long") as info:
        await engine.generate(roe.GenerateRequest(prompt_token_ids=[[4095, 4095]]))
    assert info.value.status == 400
    with pytest.raises(roe.InvalidRequest, match="outside the model's vocabulary"):  # refused before SGLang
        await engine.generate(roe.GenerateRequest(prompt_token_ids=[[10**6]]))
