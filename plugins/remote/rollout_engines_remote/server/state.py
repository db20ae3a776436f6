"""What every route shares: the served engine and the server's per-app state, and the helpers
that tie a request's work to its client (cancel on disconnect) and to the server's configuration."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request
from rollout_engines.engine import Engine
from rollout_engines.tokenization import chat_token_ids
from rollout_engines.types import Completion, GenerateRequest, StreamDelta
from rollout_engines.weights.manifest import TransportSpec

from ..metrics import ServerMetrics
from ..transport import HttpIngress
from .errors import ClientDisconnected, FieldError, Forbidden
from .limits import DEFAULT_MAX_SEQUENCES, Limits


class ServerState:
    """One app's engine and state; every routes module gets it (``router(state)``)."""

    def __init__(self, engine: Engine, model_name: str, max_sequences: int = DEFAULT_MAX_SEQUENCES, *,
                 api_key: str | None = None, weights_root: str | None = None,
                 protocols: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.model_name = model_name
        self.ingress = HttpIngress(engine)
        self.metrics = ServerMetrics()
        self.limits: Limits | None = None
        self.max_sequences = max_sequences
        self.started = time.time()
        self.init_started: float | None = None  # monotonic start of the /weights/init in progress
        self.auth = bool(api_key)
        self.weights_root = weights_root
        self.protocols = protocols
        self._tokenizing = threading.Lock()
        #: One adapter load or unload at a time (a name's version is read, then bumped).
        self.lora_lock = asyncio.Lock()

    def get_limits(self) -> Limits:
        if self.limits is None:
            self.limits = Limits(self.engine, self.max_sequences)
        return self.limits

    def count(self, outs: list[Completion]) -> None:
        """Add finished completions to the metrics."""
        m = self.metrics
        m.prompt_tokens.inc(sum(len(c.prompt_token_ids) for c in outs if c.sample_index == 0))
        m.generated_tokens.inc(sum(len(c.token_ids) for c in outs))
        for c in outs:
            m.completions.labels(c.finish_reason).inc()

    def count_delta(self, delta: StreamDelta, prompt_ids: Sequence[int] | None = None) -> None:
        """Add a streamed delta to the metrics; ``prompt_ids``, its prompt's tokens, comes with the
        first delta of the prompt's first sample (so that a streamed prompt counts once, as a
        generated one does)."""
        m = self.metrics
        if prompt_ids:
            m.prompt_tokens.inc(len(prompt_ids))
        m.generated_tokens.inc(len(delta.token_ids))
        if delta.finish_reason is not None:
            m.completions.labels(delta.finish_reason).inc()

    def delta_counter(self, req: GenerateRequest) -> Callable[[StreamDelta], Awaitable[None]]:
        """``count_delta`` for each delta of ``req``'s stream, with each prompt's tokens (where the
        server knows them) given once; a text prompt is tokenized in a thread, off the event loop."""
        counted: set[int] = set()
        read = self.prompt_reader(req)

        async def count(delta: StreamDelta) -> None:
            prompt = None
            if delta.sample_index == 0 and delta.prompt_index not in counted:
                counted.add(delta.prompt_index)
                prompt = await read(delta.prompt_index)
            self.count_delta(delta, prompt)

        return count

    def prompt_reader(self, req: GenerateRequest) -> Callable[[int], Awaitable[list[int] | None]]:
        """``prompt_tokens_of(req, i)`` for a stream's deltas: each prompt read once (a prompt's
        ``n`` samples share it), a text prompt tokenized in a thread, off the event loop."""
        known: dict[int, list[int] | None] = {}

        async def read(i: int) -> list[int] | None:
            if i not in known:
                known[i] = (list(req.prompt_token_ids[i]) if req.prompt_token_ids is not None
                            else await asyncio.to_thread(self.prompt_tokens_of, req, i))
            return known[i]

        return read

    def prompt_tokens_of(self, req: GenerateRequest, i: int) -> list[int] | None:
        """Prompt ``i`` of ``req`` as tokens where the server knows them without the engine
        (token-id prompts; text prompts through the model's tokenizer); ``None`` where it does not."""
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids[i])
        tok = self.get_limits().tokenizer
        try:
            with self._tokenizing:  # one call at a time: a fast tokenizer is not safe to share between threads
                if req.prompts is not None:
                    return list(tok(req.prompts[i])["input_ids"])
                if req.messages is not None:
                    return chat_token_ids(tok, req.messages[i])
        except Exception:  # no usable tokenizer or template: unknown
            return None
        return None

    async def generate(self, req: GenerateRequest, request: Request) -> list[Completion]:
        """Check ``req`` against the limits, generate (cancelled when the client disconnects), count."""
        self.get_limits().check(req)
        outs = await cancel_on_disconnect(request, self.engine.generate(req))
        self.count(outs)
        return outs


def confine_path(raw: object, weights_root: str | None, *, param: str, what: str) -> str:
    """``raw`` resolved (every link followed, relative to ``weights_root``) and checked to lie inside
    ``weights_root``: the one rule for every path a client names. ``what`` says what the path is
    for (the error messages name it). Raises :class:`Forbidden` or :class:`FieldError`."""
    if weights_root is None:
        raise Forbidden(f"{what} over HTTP are off on this server: start it with --weights-root DIR "
                        "(create_app(weights_root=DIR)) and have the trainer write its files under DIR", param=param)
    if not isinstance(raw, str) or not raw:
        raise FieldError(param, f"needs a folder under this server's weights root {weights_root}")
    try:
        real = os.path.realpath(os.path.join(weights_root, raw))
    except (ValueError, OSError):
        raise FieldError(param, "not a usable file-system path") from None
    if os.path.commonpath([real, weights_root]) != weights_root:
        raise Forbidden(f"{param} '{raw[:300]}' is not inside this server's weights root {weights_root} "
                        "(links are followed); write the files under that folder, or restart the server with "
                        "another --weights-root", param=param)
    return real


def confine_disk_spec(spec: TransportSpec, weights_root: str | None) -> TransportSpec:
    """``spec`` with its ``disk`` folder checked to lie inside ``weights_root`` (:func:`confine_path`)
    and replaced by its resolved path. Raises :class:`Forbidden` or :class:`FieldError`."""
    raw = spec.options.get("path")
    real = confine_path(raw, weights_root, param="options.path", what="disk weight transfers")
    if not os.path.isdir(real):
        raise FieldError("options.path", f"'{str(raw)[:300]}' is not an existing folder on the server; the trainer "
                         "creates it when it opens the transfer (connect_weight_sync)")
    return spec.model_copy(update={"options": {**spec.options, "path": real}})


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client disconnects first, cancel it and raise :class:`ClientDisconnected`."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task}, timeout=10.0)
    if task.done() and not task.cancelled():
        task.exception()  # retrieved, so that asyncio does not log it
    raise ClientDisconnected("the client disconnected; its generation was cancelled")


#: Transports whose receivers join the trainer's rendezvous store at ``options.host``/``options.port``.
STORE_TRANSPORTS = frozenset({"gloo", "nccl", "shm", "cuda_ipc", "sglang_nccl"})


def check_store_options(spec: TransportSpec, prefix: str = "") -> None:
    """``options.host`` and ``options.port`` usable as the trainer's store address: required for the
    transports that join the store, checked wherever given (the receivers read them unchecked, and
    a missing or garbled one failed deep in the engine as a 500). Raises :class:`FieldError` naming
    ``{prefix}options.host`` or ``...port``."""
    options = spec.options
    for key in ("host", "port"):
        if key not in options and spec.transport in STORE_TRANSPORTS:
            raise FieldError(f"{prefix}options.{key}", f"the '{spec.transport}' transport joins the trainer's store at "
                             "options.host:options.port; open the session with connect_weight_sync(), which "
                             "sets both")
    host = options.get("host")
    if "host" in options and (not isinstance(host, str) or not host.strip() or len(host) > 255):
        raise FieldError(f"{prefix}options.host", "must be the trainer's host name or IP address (a non-empty string)")
    port = options.get("port")
    if "port" in options:
        value = port if isinstance(port, int) and not isinstance(port, bool) else (
            int(port) if isinstance(port, str) and port.isascii() and port.isdigit() and len(port) <= 5 else None)
        if value is None or not 1 <= value <= 65535:
            raise FieldError(f"{prefix}options.port", f"must be a TCP port number, 1 to 65535 (got {str(port)[:40]!r})")
