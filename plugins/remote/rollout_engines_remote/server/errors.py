"""The server's error types and its one error shape, ``{"error": {"type", "message", "param"}}``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class FieldError(ValueError):
    """A request value the server cannot serve (beyond the core model's own validation)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class Forbidden(Exception):
    """A request the server's configuration does not allow (403)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Conflict(Exception):
    """A request that cannot run now because of one in progress (409)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; its work was cancelled."""


class BodyReadTimeout(StarletteHTTPException):
    """The client stopped sending the request body."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body did not arrive in time (no data for {timeout_s:g} s); "
                              "send the whole body without pausing, or raise the server's --body-read-timeout")


def error_body(kind: str, message: str, param: str | None = None,
               fields: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``{"error": {...}}``: what every error response (and an SSE stream's error event) carries."""
    body: dict[str, Any] = {"type": kind, "message": message, "param": param}
    if fields is not None:
        body["fields"] = fields
    return {"error": body}


def error_response(status: int, kind: str, message: str, param: str | None = None,
                   fields: list[dict[str, Any]] | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(kind, message, param, fields), status_code=status, headers=headers)


def _dotted(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts)


def validation_response(errors: Sequence[Any]) -> JSONResponse:
    fields = []
    for e in errors:
        fields.append({"param": _dotted(e.get("loc", ())), "message": str(e.get("msg", "")), "type": e.get("type")})
    first = fields[0] if fields else {"param": None, "message": "invalid request"}
    text = "; ".join(f"{f['param'] or '(body)'}: {f['message']}" for f in fields[:8])
    return error_response(422, "ValidationError", f"invalid request: {text}", param=first["param"] or None,
                          fields=fields)


_validation_response = validation_response  # the name before the split into a package
