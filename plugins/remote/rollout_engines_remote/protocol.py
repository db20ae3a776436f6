"""What crosses the wire between a rollout-engines server and its clients.

Request and response bodies of the native API reuse the core's pydantic models (GenerateRequest,
Completion, EngineInfo, TransportSpec, WeightManifest); the few bodies the core has no model for
live here. Errors travel as ``{"error": {"type", "message", "param"}}`` (OpenAI's shape), and
:func:`error_from_payload` turns them back into the core's typed exceptions on the client.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from rollout_engines import errors as core_errors
from rollout_engines.errors import RolloutEnginesError
from rollout_engines.proxy import FarEngineError, WireError
from rollout_engines.types import LORA_NAME_PATTERN, MAX_REQUEST_ID_CHARS, MAX_SEQUENCES, PauseMode

#: Environment variable holding the API key (server and client), instead of a command-line flag.
API_KEY_ENV = "ROLLOUT_ENGINES_API_KEY"


def read_api_key_file(path: str | os.PathLike[str]) -> str:
    """The API key stored in ``path`` (one line; surrounding white space removed)."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the API key file {path}: {exc.strerror or exc}") from None
    key = text.strip()
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"the API key file {path} must hold exactly one key")
    return key

#: HTTP status of each typed core error. Everything a client can cause is a 4xx; 503 means
#: "this server cannot serve now" (closed or unavailable engine).
ERROR_STATUS: dict[str, int] = {
    "InvalidRequest": 422,
    "CapabilityError": 400,
    "UnknownTransport": 400,
    "ManifestMismatch": 422,
    "EngineAsleep": 409,
    "WeightsInvalidated": 409,
    "WeightSyncError": 409,
    "EngineClosed": 503,
    "EngineUnavailable": 503,
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SleepBody(_Body):
    level: int = Field(default=1, ge=0, le=16)
    tags: list[str] | None = None


class WakeUpBody(_Body):
    tags: list[str] | None = None


class AbortBody(_Body):
    """The trainer gave up an ``http`` update; the server's receiver must stop waiting."""

    session: str
    update: str
    reason: str = ""


class AbortRequestsBody(_Body):
    """``POST /abort``: end these running requests (``request_ids``, the ids of
    ``GenerateRequest.request_ids``), or every running request (``all: true``)."""

    request_ids: list[Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS)]] | None = Field(
        default=None, max_length=MAX_SEQUENCES)
    all: bool = False

    @model_validator(mode="after")
    def _one_target(self) -> AbortRequestsBody:
        if self.all == (self.request_ids is not None):
            raise ValueError("give either request_ids (a list of request ids) or all=true")
        return self


class PauseBody(_Body):
    """``POST /pause``: ``wait`` (default) lets in-flight requests finish, ``abort`` ends them now,
    ``keep`` freezes them until ``/resume``; the engine's ``pause_modes`` capability says which it serves."""

    mode: PauseMode = "wait"


class LoraUnloadBody(_Body):
    """``POST /lora/unload``: forget the LoRA adapter ``name`` (pushed with ``WeightSync.push_lora``)."""

    name: str = Field(pattern=LORA_NAME_PATTERN)


class LoraUnloadedBody(BaseModel):
    ok: bool = True
    #: Whether the adapter was loaded (an unknown name is not an error).
    unloaded: bool


class OkBody(BaseModel):
    ok: bool = True
    weight_version: int | None = None


class VersionBody(BaseModel):
    weight_version: int


class HealthBody(BaseModel):
    status: str
    weight_version: int | None = None


class ErrorDetail(BaseModel):
    type: str
    message: str
    param: str | None = Field(default=None, description="The offending field, dotted, when there is one.")
    fields: list[dict[str, Any]] | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


# ---- client side: errors back into exceptions --------------------------------------------------
class RemoteError(RolloutEnginesError):
    """The server answered with an error that has no typed core counterpart."""

    def __init__(self, message: str, *, status: int, type: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param = status, type, param


class RemoteRequestInvalid(RemoteError, core_errors.InvalidRequest):
    """The server rejected the request as invalid (400/404/413/422): fix the request."""


class RemoteAuthError(RemoteError, PermissionError):
    """Missing or wrong API key (401): pass options={'api_key': ...} or {'api_key_file': PATH} with the
    server's key (the file it was started with, or the one it wrote and logged at start)."""


class RemoteForbidden(RemoteError, PermissionError):
    """The server's configuration refuses the request (403, e.g. a ``disk`` transfer outside its
    ``--weights-root``; 421, a Host name it does not answer to): change the request or the server's flags."""


def error_from_payload(status: int, payload: Any, where: str) -> Exception:
    """The exception a client raises for an error response (typed when the server sent a core type)."""
    detail = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(detail, dict):
        text = str(payload)[:500]
        detail = {"type": f"HTTP{status}", "message": text or f"HTTP {status}"}
    kind, message = str(detail.get("type", "")), f"{where}: {detail.get('message', '')}"
    param = detail.get("param")
    if kind and kind != "ValidationError":
        # The core's one error wire format: the same class where it is one of ours (peer and
        # bucket kept where the server sends them).
        typed = WireError.model_validate({**detail, "type": kind, "message": message}).to_exception(where)
        if isinstance(typed, RolloutEnginesError) and not isinstance(typed, FarEngineError):
            return typed
    if status == 401:
        return RemoteAuthError(message, status=status, type=kind, param=param)
    if status in (403, 421):
        return RemoteForbidden(message, status=status, type=kind, param=param)
    if kind == "InitInProgress":
        return core_errors.WeightSyncError(message)
    if status in (400, 404, 405, 413, 422):
        return RemoteRequestInvalid(message, status=status, type=kind, param=param)
    if status in (502, 503, 504):
        return core_errors.EngineUnavailable(message)
    return RemoteError(message, status=status, type=kind, param=param)
