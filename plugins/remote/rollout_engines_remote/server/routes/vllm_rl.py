"""vLLM's RL HTTP API (protocol ``vllm-rl``), spoken over any engine through the engine protocol.

Shaped like vLLM's routers (``vllm/entrypoints/rl/online/api_router.py``, the sleep and cache dev
routers, ``/inference/v1/generate``), so code written against ``vllm serve`` (vLLM's
``examples/rl/rlhf_http_*.py``, ``HTTPVLLMWeightSyncClient``, SkyRL's ``RemoteInferenceClient``)
drives SGLang, the embedded engines or a third party's backend unchanged. ``return_token_ids`` on
``/v1/completions`` is the ``openai`` protocol's; serve both (``--protocols vllm-rl,openai``).

Generation: ``POST /inference/v1/generate`` (token-in/token-out; ``stream`` too), ``POST
/inference/v1/abort_requests``. Control: ``POST /pause?mode=abort|wait|keep`` (vLLM's default
``abort``), ``/resume``, ``GET /is_paused``, ``POST /abort_requests`` (no ids: all), ``POST
/sleep?level=``, ``/wake_up?tags=``, ``GET /is_sleeping``, ``POST /reset_prefix_cache``. These
paths are also the ``native`` protocol's (JSON bodies, default ``wait``): where both are served,
the protocol listed first answers them; the ones here take vLLM's query parameters.

Weights, the four phases: ``/init_weight_transfer_engine`` ``{"init_info": {...}}``,
``/start_weight_update``, ``/update_weights`` ``{"update_info": {...} | [...]}``,
``/finish_weight_update`` ``{"weight_version": ...}``; ``/shutdown_weight_transfer_engine``,
``GET /get_world_size``, ``GET /weight_info``. ``init_info["backend"]`` (vLLM picks it at server
start with ``--weight-transfer-config``; here it comes with the init) chooses how the bytes travel:

- ``http`` (the default; CPU, no collective): each ``update_info`` carries ``names``,
  ``dtype_names``, ``shapes`` (vLLM's fields) and ``data_b64``, one base64 string per tensor of its
  raw bytes (C order, little endian). The server collects the chunks of one update and applies
  them as ONE complete update at ``/finish_weight_update`` (through the server's ``http`` relay:
  manifest validation, checksums and the atomic apply are the core's). A chunk must fit the server's
  body limit (``--max-body-bytes``): send a large model in several ``update_weights`` calls.
- ``nccl``, ``ipc`` (= our ``cuda_ipc``), ``gloo``, ``shm`` and any transport the engine declares:
  ``init_info`` is a :class:`~rollout_engines.weights.manifest.TransportSpec` (``session_id``,
  ``rank_offset``, ``world_size``, ``timeout_s``, ``options``) from our trainer-side sender, and each
  ``update_info`` adds ``manifest`` (our :class:`~rollout_engines.weights.manifest.WeightManifest`,
  whose layout the sender's buckets follow; ``names``/``dtype_names``/``shapes`` must agree with
  it); each ``update_weights`` call receives one complete update.

Not supported, answered 400 naming what is: vLLM's own trainer-side wire protocols (its
``NCCLTrainerWeightTransferEngine`` packing, pickled CUDA IPC handles: we never unpickle), the
``sparse_nccl``/``sharded_rdt``/``nccl_m2n`` backends, ``/start_draft_weight_update``,
``/update_weight_version`` and ``/weight_checker`` (the engine protocol exposes neither labels nor
per-weight checksums).

Versions: a vLLM update has none. The new version is the served one + 1 (so outputs' versions
increase with every update), unless ``/finish_weight_update`` names an integer above it
(``http``) or the manifest's version is above it (transports). ``/weight_info`` answers it as a
string, as vLLM does.

Authentication: the Guard's, unchanged (``Authorization: Bearer``). vLLM's
``HTTPVLLMWeightSyncClient`` and its examples send no key: serve those with ``--insecure-no-auth``
on a loopback address only.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
import uuid
import weakref
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from rollout_engines.errors import CapabilityError
from rollout_engines.types import Completion, GenerateRequest, SamplingParams, StreamDelta, TokenLogprob
from rollout_engines.weights.manifest import (
    DEFAULT_TIMEOUT_S,
    DTYPE_SIZES,
    TensorSpec,
    TransportSpec,
    WeightManifest,
    check_timeout,
    plan_manifest,
)

from ..errors import Conflict, FieldError
from ..sse import EventStreamResponse, event, events_of, first_item
from ..state import ServerState, check_store_options, confine_disk_spec

PauseModeQ = Literal["abort", "wait", "keep"]
#: vLLM weight-transfer backend names -> our transports (any other name of a transport passes as is).
BACKENDS = {"ipc": "cuda_ipc", "nccl": "nccl", "gloo": "gloo"}
#: vLLM backends with wire protocols of their own that no transport of ours speaks.
FOREIGN_BACKENDS = ("sparse_nccl", "sharded_rdt", "nccl_m2n", "modelexpress")
#: vLLM sampling parameters mapped onto the core's.
_MAPPED = {"temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "stop_token_ids", "ignore_eos",
           "seed", "n", "logprobs", "prompt_logprobs"}
#: Parameters that only shape text (tokens out are the same), accepted and ignored.
_TEXT_ONLY = {"detokenize", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
              "output_kind", "flat_logprobs", "logprob_token_ids"}
#: Parameters accepted at vLLM's neutral value only (anything else is a 400 naming them).
_NEUTRAL: dict[str, Any] = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                            "min_tokens": 0, "best_of": 1}


def _sampling(sp: dict[str, Any]) -> SamplingParams:
    """The core's sampling parameters of a vLLM ``sampling_params`` object (400 for what is not served)."""
    out: dict[str, Any] = {}
    for key, value in sp.items():
        if key in _MAPPED:
            if value is not None:
                out[key] = value
        elif key in _TEXT_ONLY or value is None or value is False or value == _NEUTRAL.get(key, object()):
            continue
        elif value in ([], {}, ""):
            continue
        else:
            raise FieldError(f"sampling_params.{key}", f"not served by this server (value {value!r}); it serves "
                             f"{', '.join(sorted(_MAPPED))}")
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    k = out.get("logprobs")
    if k:  # vLLM's logprobs=k: the sampled token's logprob and the k most likely tokens
        out["top_logprobs"] = k
    return SamplingParams(**out)


class VllmGenerateBody(BaseModel):
    """``POST /inference/v1/generate``, vLLM's token-in/token-out request (the fields served)."""

    model_config = ConfigDict(extra="allow")

    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=256)
    token_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    stream: bool | None = False
    return_token_ids: bool | None = None
    output_mode: Literal["tokens"] = "tokens"
    features: Any = None
    content_parts: Any = None


def _logprobs(c: Completion | StreamDelta) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    tops: list[list[TokenLogprob]] = c.top_logprobs or [[] for _ in c.token_ids]
    return {"content": [
        {"token_id": t, "logprob": lp,
         "top_logprobs": [{"token_id": x.token_id, "logprob": x.logprob, "rank": r + 1} for r, x in enumerate(top)]}
        for t, lp, top in zip(c.token_ids, c.logprobs, tops, strict=False)]}


def _version_spans(c: Completion) -> list[dict[str, Any]]:
    """vLLM's ``weight_versions``: ``[start, end)`` spans of output tokens per version (as strings)."""
    per = c.token_weight_versions or [c.weight_version] * len(c.token_ids)
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(per):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def _prompt_logprobs(c: Completion) -> list[dict[str, dict[str, Any]] | None] | None:
    if c.prompt_logprobs is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    tops = c.prompt_top_logprobs or [[] for _ in c.prompt_logprobs]
    for i, lp in enumerate(c.prompt_logprobs):
        if lp is None:
            out.append(None)
            continue
        tok = c.prompt_token_ids[i]
        pos = {str(tok): {"logprob": lp, "rank": None, "decoded_token": None}}
        for r, x in enumerate(tops[i] if i < len(tops) else []):
            pos.setdefault(str(x.token_id), {"logprob": x.logprob, "rank": r + 1, "decoded_token": None})
        out.append(pos)
    return out


class InitInfo(BaseModel):
    """``init_info``: the backend (vLLM's name, or ``transport``, ours), ``timeout_s``, and for a
    transport the rest of a :class:`~rollout_engines.weights.manifest.TransportSpec` (``session_id``,
    ``rank_offset``, ``world_size``, ``options``: checked by it)."""

    model_config = ConfigDict(extra="allow")

    backend: str | None = None
    transport: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    @field_validator("timeout_s")
    @classmethod
    def _bounded(cls, value: float) -> float:
        return check_timeout(value)

    @model_validator(mode="after")
    def _one_backend(self) -> InitInfo:
        if self.backend and self.transport and BACKENDS.get(self.backend, self.backend) != self.transport:
            raise ValueError(f"backend '{self.backend}' and transport '{self.transport}' name different transports; "
                             "give one of them")
        return self

    @property
    def name(self) -> str:
        """The backend asked for (vLLM's name where given), ``http`` by default."""
        return self.backend or self.transport or "http"


class InitBody(BaseModel):
    init_info: InitInfo = Field(default_factory=InitInfo)


class StartBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    is_checkpoint_format: bool = True
    partial: bool = Field(default=False, description="rollout-engines extra: the update carries only some tensors.")


class UpdateInfo(BaseModel):
    """One ``update_info``: vLLM's per-tensor fields (one entry per tensor each), with ``data_b64``
    (backend ``http``) or ``manifest`` (a transport)."""

    model_config = ConfigDict(extra="allow")

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    data_b64: list[str] | None = None
    manifest: WeightManifest | None = None

    @field_validator("dtype_names")
    @classmethod
    def _known_dtypes(cls, dtypes: list[str]) -> list[str]:
        for d in dtypes:
            if d not in DTYPE_SIZES:
                raise ValueError(f"unsupported dtype {d!r}; use one of {sorted(DTYPE_SIZES)}")
        return dtypes

    @model_validator(mode="after")
    def _one_entry_per_tensor(self) -> UpdateInfo:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names ({len(self.names)}), dtype_names ({len(self.dtype_names)}) and shapes "
                             f"({len(self.shapes)}) must have one entry per tensor")
        return self

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(name=n, dtype=d, shape=tuple(s))
                for n, d, s in zip(self.names, self.dtype_names, self.shapes, strict=True)]


class UpdateBody(BaseModel):
    #: One ``update_info`` object or a list of them.
    update_info: list[UpdateInfo]

    @field_validator("update_info", mode="before")
    @classmethod
    def _listed(cls, value: Any) -> Any:
        return [value] if isinstance(value, dict) else value


class FinishBody(BaseModel):
    weight_version: str | int | None = None


@dataclass
class _Transfer:
    """The weight transfer a vLLM-style trainer set up, and the update it is sending."""

    backend: str  # "http" or one of the engine's transports
    spec: TransportSpec
    started: bool = False
    partial: bool = False
    specs: list[TensorSpec] = field(default_factory=list)
    data: dict[str, bytes] = field(default_factory=dict)
    applied: int | None = None  # transports: the version the last update_weights applied


#: One router per server state: the ``skyrl`` protocol reuses the handlers (and the weight transfer
#: they hold) of the ``vllm-rl`` one of its server.
_ROUTERS: weakref.WeakKeyDictionary[ServerState, APIRouter] = weakref.WeakKeyDictionary()


def router(state: ServerState) -> APIRouter:
    r = _ROUTERS.get(state)
    if r is None:
        r = _ROUTERS[state] = _make_router(state)
    return r


def _make_router(state: ServerState) -> APIRouter:
    r = APIRouter(tags=["vllm-rl"])
    engine = state.engine
    #: vLLM request id -> the core's sequence ids of its samples, while it runs.
    running: dict[str, list[str]] = {}
    transfer: list[_Transfer] = []  # zero or one
    update_lock = asyncio.Lock()

    # ---- generation ----------------------------------------------------------------------------
    def core_request(body: VllmGenerateBody, request: Request) -> GenerateRequest:
        if body.features is not None or body.content_parts is not None:
            raise FieldError("features", "multimodal inputs are not served by /inference/v1/generate here")
        sampling = _sampling(body.sampling_params)
        caps = engine.capabilities
        if sampling.top_logprobs and sampling.top_logprobs > caps.top_logprobs:
            sampling = sampling.model_copy(update={"top_logprobs": None})
        n = sampling.n
        ids = [body.request_id] if n == 1 else [f"{body.request_id}-{i}" for i in range(n)]
        session = request.headers.get("x-session-id") or None
        return GenerateRequest(prompt_token_ids=[list(body.token_ids)], sampling=sampling, request_ids=ids,
                               session_id=session)

    def register(request_id: str, req: GenerateRequest) -> list[str]:
        """Map ``request_id`` to its samples' sequence ids while it runs; returns the entry to release."""
        entry = running[request_id] = list(req.request_ids or [])
        return entry

    def release(request_id: str, entry: list[str]) -> None:
        # Only this request's own entry: a later request reusing the id keeps its mapping.
        if running.get(request_id) is entry:
            del running[request_id]

    @r.post("/inference/v1/generate")
    async def inference_generate(body: VllmGenerateBody, request: Request) -> Any:
        """vLLM's token-in/token-out generation: ``token_ids`` and ``sampling_params`` in, each sample's
        ``token_ids`` (and ``logprobs.content``, ``weight_versions``) out; ``stream: true`` sends
        vLLM's token chunks as server-sent events."""
        req = core_request(body, request)
        if body.stream:
            return await stream_generate(body, req, request)
        entry = register(body.request_id, req)
        try:
            outs = await state.generate(req, request)
        finally:
            release(body.request_id, entry)
        first = outs[0] if outs else None
        answer: dict[str, Any] = {
            "request_id": body.request_id, "model": body.model or state.model_name, "created": int(time.time()),
            "output_mode": "tokens",
            "choices": [{"index": c.sample_index, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                         "stop_reason": None, "logprobs": _logprobs(c), "weight_versions": _version_spans(c)}
                        for c in outs],
            "usage": {"prompt_tokens": len(body.token_ids), "completion_tokens": sum(len(c.token_ids) for c in outs),
                      "total_tokens": len(body.token_ids) + sum(len(c.token_ids) for c in outs)},
        }
        if body.return_token_ids:
            answer["prompt_token_ids"] = list(body.token_ids)
        if first is not None and first.prompt_logprobs is not None:
            answer["prompt_logprobs"] = _prompt_logprobs(first)
        return JSONResponse(answer)

    async def stream_generate(body: VllmGenerateBody, req: GenerateRequest, request: Request) -> Response:
        state.get_limits().check(req)
        entry = register(body.request_id, req)
        source = engine.stream(req)
        try:
            first = await first_item(request, source)
        except BaseException:
            release(body.request_id, entry)
            raise

        count = state.delta_counter(req)

        async def chunks() -> AsyncGenerator[bytes, None]:
            sent_prompt = False
            try:
                delta: StreamDelta | None = first
                while delta is not None:
                    await count(delta)
                    chunk: dict[str, Any] = {
                        "request_id": body.request_id, "output_mode": "tokens",
                        "choices": [{"index": delta.sample_index, "token_ids": delta.token_ids,
                                     "finish_reason": delta.finish_reason, "logprobs": _logprobs(delta),
                                     "weight_versions": [{"version": str(delta.weight_version), "start": 0,
                                                          "end": len(delta.token_ids)}]}]}
                    if body.return_token_ids and not sent_prompt:
                        chunk["prompt_token_ids"] = list(body.token_ids)
                        sent_prompt = True
                    yield event(json.dumps(chunk))
                    delta = await anext(source, None)
            finally:
                release(body.request_id, entry)
                await source.aclose()

        return EventStreamResponse(events_of(chunks()))

    async def abort_ids(request_ids: list[str] | None) -> int:
        """Abort the named requests (``None``: all of them; an empty list: none)."""
        if request_ids is None:
            count = len(running)
            await engine.abort_all()
            return count
        if not request_ids:
            return 0
        ours = [sid for rid in request_ids for sid in running.get(rid, [rid])]
        await engine.abort(ours)
        return len(request_ids)

    async def json_object(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError:
            raise FieldError("(body)", "invalid JSON") from None
        if not isinstance(body, dict):
            raise FieldError("(body)", "the request body must be a JSON object")
        return body

    @r.post("/inference/v1/abort_requests")
    async def inference_abort(request: Request) -> Response:
        """Abort requests by their vLLM ``request_id`` (``{"request_ids": [...]}``, required)."""
        ids = (await json_object(request)).get("request_ids")
        if not isinstance(ids, list):
            raise FieldError("request_ids", "missing 'request_ids' (a list of request ids)")
        await abort_ids([str(i) for i in ids])
        return Response(status_code=200)

    @r.post("/abort_requests")
    async def abort_requests(request: Request) -> JSONResponse:
        """Abort in-flight requests without pausing; no ``request_ids``: all of them."""
        ids = (await json_object(request)).get("request_ids")
        if ids is not None and not isinstance(ids, list):
            raise FieldError("request_ids", "must be a list of request ids")
        count = await abort_ids(None if ids is None else [str(i) for i in ids])
        return JSONResponse({"status": "aborted", "aborted": count})

    # ---- control -------------------------------------------------------------------------------
    @r.post("/pause")
    async def pause(mode: Annotated[PauseModeQ, Query()] = "abort",
                    clear_cache: Annotated[bool, Query()] = True) -> JSONResponse:
        """Hold generation until ``/resume``. ``mode``: ``abort`` (vLLM's default) ends in-flight
        requests now, ``wait`` lets them finish first, ``keep`` freezes them until ``/resume``;
        ``clear_cache`` (not with ``keep``) resets the prefix cache once paused."""
        await engine.pause(mode)
        if clear_cache and mode != "keep":
            await engine.reset_prefix_cache()
        return JSONResponse({"status": "paused"})

    @r.post("/resume")
    async def resume() -> JSONResponse:
        await engine.resume()
        return JSONResponse({"status": "resumed"})

    @r.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": (await engine.info()).paused})

    @r.post("/sleep")
    async def sleep(level: Annotated[int, Query(ge=0, le=2)] = 1,
                    mode: Annotated[PauseModeQ, Query()] = "abort",
                    tags: Annotated[list[str] | None, Query()] = None) -> JSONResponse:
        """Release memory (``level`` 1: keep the weights, 2: discard them). vLLM's ``mode`` says what
        happens to requests in flight: ``abort`` ends them first (with the ``abort`` capability),
        ``wait``/``keep`` sleep once the engine allows it. ``tags``: what to release (default all)."""
        if level == 0:
            return JSONResponse({"status": "sleeping", "level": level})  # vLLM: level 0 releases nothing
        if mode == "abort" and engine.capabilities.abort:
            await engine.abort_all()
        await engine.sleep(level, tags or None)
        return JSONResponse({"status": "sleeping", "level": level})

    @r.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> JSONResponse:
        await engine.wake_up(tags or None)
        asleep = (await engine.info()).asleep
        return JSONResponse({"status": "sleeping" if asleep else "awake", "tags": tags or None})

    @r.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": bool((await engine.info()).asleep)})

    @r.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False) -> JSONResponse:
        await engine.reset_prefix_cache()
        return JSONResponse({"success": True})

    # ---- weights -------------------------------------------------------------------------------
    @r.get("/get_world_size")
    async def get_world_size(include_dp: bool = True) -> JSONResponse:
        """Ranks this engine occupies in a broadcast group (the trainer's world is this + 1)."""
        return JSONResponse({"world_size": engine.weight_receivers()})

    @r.get("/weight_info")
    async def weight_info() -> JSONResponse:
        return JSONResponse({"weight_version": str(engine.weight_version)})

    def current() -> _Transfer:
        if not transfer:
            raise Conflict("NoWeightTransfer", "no weight transfer is set up; call /init_weight_transfer_engine first")
        return transfer[0]

    async def open_http(t: _Transfer) -> None:
        s = state.ingress.session
        if s is None or s.spec.session_id != t.spec.session_id:
            await state.ingress.open(t.spec)

    @r.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: InitBody) -> JSONResponse:
        """Set up the weight transfer: ``init_info["backend"]`` ``http`` (default) or one of the
        engine's transports (``nccl``, ``ipc`` = ``cuda_ipc``, ``gloo``, ...) with a TransportSpec."""
        info = body.init_info
        name = info.name
        transports = list(engine.capabilities.transports)
        if name in FOREIGN_BACKENDS:
            raise CapabilityError(f"weight-transfer backend '{name}' is vLLM's own protocol and is not served here; "
                                  f"use 'http' or one of this engine's transports: {', '.join(transports)}")
        backend = "http" if name == "http" else BACKENDS.get(name, name)
        if backend != "http" and "session_id" not in (info.model_extra or {}):
            raise CapabilityError(
                f"init_info for backend '{name}' must be a rollout-engines TransportSpec (session_id, rank_offset, "
                "world_size, timeout_s, options) from our trainer-side sender: vLLM's own trainer engines "
                "(master_address/master_port rendezvous, packed NCCL broadcast, pickled IPC handles) are not "
                "spoken here. Without a GPU transport use backend 'http' (tensor bytes in update_weights)")
        if state.init_started is not None:
            raise Conflict("InitInProgress", "a weight-sync init is in progress; retry once it has answered")
        async with update_lock:
            if backend == "http":
                spec = TransportSpec(transport="http", session_id=f"vllm-rl-{uuid.uuid4().hex}",
                                     timeout_s=info.timeout_s)
            else:
                if backend not in transports:
                    raise CapabilityError(f"this server's engine cannot receive weights over '{backend}'; it "
                                          f"supports: http, {', '.join(transports)}")
                spec = TransportSpec(transport=backend, timeout_s=info.timeout_s, **(info.model_extra or {}))
                if backend == "disk":
                    spec = confine_disk_spec(spec, state.weights_root)
                check_store_options(spec, prefix="init_info.")
            state.init_started = time.monotonic()
            try:
                if backend == "http":
                    await state.ingress.open(spec)
                else:
                    await engine.init_weight_transfer(spec)
            finally:
                state.init_started = None
            transfer[:] = [_Transfer(backend=backend, spec=spec)]
        return JSONResponse({"message": "Weight transfer initialized", "backend": backend})

    @r.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine() -> JSONResponse:
        async with update_lock:
            had = transfer[:]
            transfer.clear()
            if had and had[0].backend == "http":
                s = state.ingress.session
                if s is not None and s.spec.session_id == had[0].spec.session_id:
                    await state.ingress.close()
            elif had:
                await engine.close_weight_transfer()
        return JSONResponse({"message": "Weight transfer shut down"})

    @r.post("/start_weight_update")
    async def start_weight_update(body: StartBody | None = None) -> JSONResponse:
        """Begin one update (what ``/update_weights`` sends until ``/finish_weight_update`` is one version)."""
        t = current()
        t.started, t.partial, t.specs, t.data, t.applied = True, bool(body and body.partial), [], {}, None
        return JSONResponse({"message": "Weight update started"})

    @r.post("/start_draft_weight_update")
    async def start_draft_weight_update() -> JSONResponse:
        raise CapabilityError("draft-model weight updates are not supported: the engine protocol has no draft model")

    @r.post("/update_weights")
    async def update_weights(body: UpdateBody) -> JSONResponse:
        """One chunk of the update: ``http``: tensors with their bytes (``data_b64``), applied at
        finish; transports: ``manifest`` (the sender's layout), received now."""
        t = current()
        if not t.started:
            raise Conflict("NoWeightUpdate", "call /start_weight_update before /update_weights")
        for info in body.update_info:
            if {"ipc_handles", "ipc_handles_pickled"} & set(info.model_extra or {}):
                raise CapabilityError("vLLM's CUDA IPC handles are not accepted (they would have to be unpickled); "
                                      "use backend 'ipc' with a rollout-engines manifest, or 'http'")
        # Every chunk of the request is checked before any is kept or received: a refused request
        # changes nothing, and the client can send it again corrected.
        if t.backend == "http":
            tensors = decoded(t, body.update_info)
            t.specs.extend(spec for spec, _ in tensors)
            t.data.update((spec.name, raw) for spec, raw in tensors)
        else:
            for manifest in [sender_manifest(t, info) for info in body.update_info]:
                await receive_chunk(t, manifest)
        return JSONResponse({"message": "Weights updated"})

    def decoded(t: _Transfer, infos: list[UpdateInfo]) -> list[tuple[TensorSpec, bytes]]:
        """Every tensor of ``infos`` with its bytes, checked against each other and the update so far."""
        out: list[tuple[TensorSpec, bytes]] = []
        seen = set(t.data)
        for info in infos:
            specs = info.specs()
            if info.data_b64 is None or len(info.data_b64) != len(specs):
                raise FieldError("update_info.data_b64", "backend 'http' needs data_b64: one base64 string of raw "
                                 "tensor bytes per name (vLLM's own backends move the bytes out of band; here they "
                                 "come with the request)")
            for spec, text in zip(specs, info.data_b64, strict=True):
                if spec.name in seen:
                    raise FieldError("update_info.names", f"tensor '{spec.name}' was sent twice in this update")
                seen.add(spec.name)
                try:
                    raw = base64.b64decode(text, validate=True)
                except (binascii.Error, ValueError):
                    raise FieldError("update_info.data_b64", f"'{spec.name}': not base64") from None
                if len(raw) != spec.nbytes:
                    raise FieldError("update_info.data_b64", f"'{spec.name}': {len(raw)} bytes, expected "
                                     f"{spec.nbytes} for {spec.dtype}{list(spec.shape)}")
                out.append((spec, raw))
        return out

    def sender_manifest(t: _Transfer, info: UpdateInfo) -> WeightManifest:
        """The manifest of one transport chunk, checked against its names, dtypes and shapes."""
        manifest = info.manifest
        if manifest is None:
            raise FieldError("update_info.manifest", f"backend '{t.backend}' needs the sender's manifest "
                             "(rollout-engines WeightManifest) in update_info['manifest']")
        laid = [(p.name, p.dtype, tuple(p.shape)) for p in manifest.tensors]
        if laid != [(s.name, s.dtype, tuple(s.shape)) for s in info.specs()]:
            raise FieldError("update_info.manifest", "names, dtype_names and shapes disagree with the manifest")
        return manifest

    async def receive_chunk(t: _Transfer, manifest: WeightManifest) -> None:
        version = max(manifest.version, engine.weight_version + 1)
        manifest = manifest.model_copy(update={"version": version, "transport": t.backend,
                                               "partial": manifest.partial or t.partial})
        async with update_lock:
            t.applied = await engine.receive_weights(manifest)
        state.metrics.weight_updates.labels("ok").inc()
        state.metrics.weight_version.set(t.applied)

    @r.post("/finish_weight_update")
    async def finish_weight_update(body: FinishBody | None = None) -> JSONResponse:
        """End the update: ``http`` applies what was sent as one complete update (the new version:
        ``weight_version`` if an integer above the served one, else served + 1)."""
        t = current()
        if not t.started:
            raise Conflict("NoWeightUpdate", "no weight update was started; call /start_weight_update first")
        wanted = body.weight_version if body else None
        if wanted is not None:
            try:
                wanted = int(wanted)
            except (TypeError, ValueError):
                raise FieldError("weight_version", "versions are integers here (each update's is above the last)") \
                    from None
        if t.backend != "http":
            if t.applied is None:
                raise Conflict("NoWeightUpdate", "nothing was received since /start_weight_update")
            if wanted is not None and wanted != t.applied:
                raise FieldError("weight_version", f"the update was applied as version {t.applied}")
            t.started = False
            return JSONResponse({"message": "Weight update finished", "weight_version": str(t.applied)})
        if not t.specs:
            raise Conflict("NoWeightUpdate", "no tensors were sent since /start_weight_update")
        version = wanted if wanted is not None else engine.weight_version + 1
        try:
            applied = await push_http(t, version)
        except BaseException:
            state.metrics.weight_updates.labels("failed").inc()
            raise
        finally:
            t.started, t.specs, t.data = False, [], {}
        state.metrics.weight_updates.labels("ok").inc()
        state.metrics.weight_version.set(applied)
        return JSONResponse({"message": "Weight update finished", "weight_version": str(applied)})

    async def push_http(t: _Transfer, version: int) -> int:
        """Relay the collected tensors through the server's ``http`` ingress as one versioned update."""
        manifest = plan_manifest(t.specs, version=version, transport="http", timeout_s=t.spec.timeout_s,
                                 partial=t.partial)

        def bucket(index: int) -> torch.Tensor:
            buf = torch.zeros(manifest.buckets[index].nbytes, dtype=torch.uint8)
            for p in manifest.bucket_tensors(index):
                if p.nbytes:
                    buf[p.offset:p.offset + p.nbytes] = torch.frombuffer(bytearray(t.data[p.name]), dtype=torch.uint8)
            return buf

        async with update_lock:
            await open_http(t)
            return await state.ingress.push(manifest, bucket)

    @r.post("/update_weight_version")
    async def update_weight_version(new_version: Annotated[str, Body(embed=True)]) -> JSONResponse:
        raise CapabilityError("weight versions are set by updates here (each one above the last), not relabelled; "
                              "pass weight_version to /finish_weight_update instead")

    @r.post("/weight_checker")
    async def weight_checker(request: Request) -> JSONResponse:
        raise CapabilityError("/weight_checker is not supported: the engine protocol exposes no per-weight "
                              "checksums (updates are checked by the core's manifest validation and bucket checksums)")

    return r

