"""Reading one ``http`` weight-transport frame from a request body as it streams in: an 8-byte
header length, a safetensors JSON header (session, update, index, checksum in its metadata) and
one flat ``U8`` tensor, the bucket, copied straight into a preallocated buffer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import torch

from ..transport import MAX_FRAME_HEADER, parse_frame_header
from .errors import FieldError

REQUIRED_META = ("session", "update", "index")


async def read_bucket_frame(stream: AsyncIterator[bytes], content_length: str | None) -> tuple[dict[str, Any], torch.Tensor]:
    """The frame's metadata and its bucket (a uint8 tensor). Raises :class:`FieldError` (422)
    for a frame that is malformed, truncated, longer than its tensor, or whose size disagrees with
    ``content_length`` (required)."""
    if content_length is None:
        raise FieldError("content-length", "bucket frames need a Content-Length header")
    pending = bytearray()
    async for chunk in stream:
        pending += chunk
        if len(pending) >= 8:
            break
    if len(pending) < 8:
        raise FieldError("body", "bucket frame shorter than its 8-byte header length")
    hlen = int.from_bytes(pending[:8], "little")
    if hlen > MAX_FRAME_HEADER:
        raise FieldError("body", f"bucket frame header of {hlen} bytes is larger than {MAX_FRAME_HEADER}")
    while len(pending) < 8 + hlen:
        more = await anext(stream, None)
        if more is None:
            raise FieldError("body", "bucket frame ended inside its header")
        pending += more
    try:
        meta, nbytes = parse_frame_header(bytes(pending[8 : 8 + hlen]))
        for key in REQUIRED_META:
            if key not in meta:
                raise ValueError(f"bucket frame metadata lacks '{key}'")
    except ValueError as exc:
        raise FieldError("body", str(exc)) from None
    if int(content_length) != 8 + hlen + nbytes:
        raise FieldError("content-length", f"{content_length} != frame size {8 + hlen + nbytes}")
    buf = torch.empty(nbytes, dtype=torch.uint8)
    view = buf.numpy().data.cast("B")
    first = bytes(pending[8 + hlen :])
    pos = len(first)
    if pos > nbytes:
        raise FieldError("body", "bucket frame is longer than its tensor")
    view[:pos] = first
    async for chunk in stream:
        end = pos + len(chunk)
        if end > nbytes:
            raise FieldError("body", "bucket frame is longer than its tensor")
        view[pos:end] = chunk
        pos = end
    if pos != nbytes:
        raise FieldError("body", f"bucket frame truncated: {pos} of {nbytes} bytes")
    return meta, buf
