"""``rollout-engines serve``: any installed backend behind HTTP (FastAPI + uvicorn).

Endpoints (all but ``/health`` need ``Authorization: Bearer KEY``):

- OpenAI-compatible: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``:
  server-sent chunks; ``echo`` + ``logprobs`` for log-likelihoods; ``"model": <LoRA adapter>``
  selects it), ``GET /v1/models``; vLLM's runtime LoRA routes ``POST /v1/load_lora_adapter`` (a PEFT
  folder under ``--weights-root``) and ``/v1/unload_lora_adapter``.
- Native token-in/token-out: ``POST /generate`` takes a core ``GenerateRequest`` and returns the
  list of core ``Completion`` objects; ``POST /generate/stream`` sends its ``StreamDelta`` objects
  as server-sent events (then ``data: [DONE]``); ``POST /abort`` ends running requests by id.
- Control plane: ``POST /sleep``, ``/wake_up``, ``/reset_prefix_cache``, ``/pause`` (``{"mode":
  "wait" | "abort" | "keep"}``), ``/resume``;
  weight sync ``POST /weights/init`` (a ``TransportSpec``), ``/weights/update`` (a manifest; blocks
  until the update is applied), ``/weights/bucket`` (``http`` transport frames), ``/weights/abort``,
  ``/weights/close``, ``GET /weights/version``; ``GET /info``, ``/health``, ``/metrics``.

Client mistakes never give a 5xx: bad JSON or parameters are 422 naming the field, oversized
bodies 413, typed engine errors 400/409 (and 503 when the engine is closed), always as
``{"error": {"type", "message", "param"}}``.

Security (secure by default; see the project's SECURITY.md):

- The key is required unless auth is turned off explicitly (``--insecure-no-auth``, or
  ``create_app(insecure_no_auth=True)``; a warning is logged at every start). The CLI takes it from
  ``--api-key-file PATH``, ``$ROLLOUT_ENGINES_API_KEY`` or ``--api-key`` (visible to every local user
  in ``ps``); with none of them it generates one and writes it to a file only the user can read
  (``$XDG_RUNTIME_DIR/rollout-engines/serve-PORT.key``, else ``~/.cache/rollout-engines/serve-PORT.key``),
  logging the file's path, never the key.
- Every request's ``Host`` header must name this server (DNS rebinding): loopback names, the
  address it is bound to (or, bound to all addresses, the address the request came in on and this
  machine's host names), plus ``--allowed-hosts``; others get 421. ``--allowed-hosts '*'`` turns
  the check off.
- ``disk`` weight transfers and ``/v1/load_lora_adapter`` must use a folder under ``--weights-root``;
  without one they are refused.
- At most ``--max-concurrency`` requests are handled at once (beyond: 503, ``Retry-After: 1``); a
  request body must arrive within ``--body-read-timeout`` seconds (buckets: with no pause longer
  than that), else 408. A generate whose client disconnects is cancelled. One ``/weights/init`` runs
  at a time; a second one, while the first is in progress, gets 409 (retry after the first answers:
  it ends within its spec's ``timeout_s``).
- uvicorn has no timeout for reading request headers: a server reachable by untrusted clients
  must sit behind a reverse proxy that bounds header reads (and terminates TLS).

The package, one module per seam: :mod:`.app` (``create_app``), :mod:`.guard` (the pure-ASGI
checks in front of the app), :mod:`.limits`, :mod:`.errors`, :mod:`.state` (what routes share),
:mod:`.sse` (server-sent events), :mod:`.frames` (``http`` weight frames), :mod:`.routes` (one
``router(state)`` per surface, mounted per protocol: ``native``, ``openai``) and :mod:`.cli`
(``rollout-engines serve``).
"""


from __future__ import annotations

from .app import create_app, fastapi_app, install_error_handlers
from .cli import (
    AcceptErrorFilter,
    KeyFileError,
    build_parser,
    default_key_file,
    install_accept_error_filter,
    main,
    read_key_file,
    resolve_api_key,
    write_key_file,
)
from .errors import (
    BodyReadTimeout,
    ClientDisconnected,
    Conflict,
    FieldError,
    Forbidden,
    error_body,
    error_response,
    validation_response,
)
from .guard import KNOWN_PATHS, LOOPBACK_HOSTS, ASGIApp, Guard, allowed_hosts_for, host_name
from .limits import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_BUCKET_BYTES,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_MAX_SEQUENCES,
    DEFAULT_TIMEOUT_KEEP_ALIVE_S,
    MAX_TOP_K,
    Limits,
)
from .routes import DEFAULT_PROTOCOLS, PROTOCOLS
from .sse import EventStreamResponse
from .state import ServerState, cancel_on_disconnect, confine_disk_spec

__all__ = [
    "ASGIApp", "DEFAULT_BODY_READ_TIMEOUT_S", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_BUCKET_BYTES",
    "DEFAULT_MAX_CONCURRENCY", "DEFAULT_MAX_SEQUENCES", "DEFAULT_PROTOCOLS", "DEFAULT_TIMEOUT_KEEP_ALIVE_S",
    "KNOWN_PATHS", "LOOPBACK_HOSTS", "MAX_TOP_K", "PROTOCOLS", "AcceptErrorFilter", "BodyReadTimeout",
    "ClientDisconnected", "Conflict", "EventStreamResponse", "FieldError", "Forbidden", "Guard", "KeyFileError",
    "Limits", "ServerState", "allowed_hosts_for", "build_parser", "cancel_on_disconnect", "confine_disk_spec",
    "create_app", "default_key_file", "error_body", "error_response", "fastapi_app", "host_name",
    "install_accept_error_filter", "install_error_handlers", "main", "read_key_file", "resolve_api_key",
    "validation_response", "write_key_file",
]
