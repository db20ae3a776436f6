"""Zero-copy ``cuda_ipc``: engine workers read the trainer's own tensors, shared by allocation.

Packing a state dict into a bucket and unpacking it in the engine moves every byte twice, so a
bucketed push can reach at most half of the GPU's copy bandwidth. When the trainer's tensors are
plain CUDA allocations on the receiver's GPU (what PyTorch's caching allocator hands out), the
sender instead exports each *allocation* (``cuIpcGetMemHandle`` on the segment that holds the
tensor, through NVIDIA's ``cuda-bindings``) and describes each tensor as (segment, byte offset);
the worker maps each segment once (``cuIpcOpenMemHandle``) and copies straight from the trainer's
memory into its parameters: one copy.

Lifetime rules (a mapping must never outlive the allocation it maps):

- the sender keeps a reference to every tensor it described until receivers acknowledged it;
- segments of tensors the trainer keeps (parameters, views of a storage someone else holds such
  as ``state_dict()``'s, tensor objects pushed before: a dict pushed every step) stay mapped
  between pushes. The sender holds one of their tensors per segment, so the segment cannot be
  freed while mapped; that costs no memory as long as the trainer holds them too. Once the
  trainer dropped them, the next push tells receivers to unmap them, and the sender lets go
  after the first bucket is acknowledged;
- every other segment (temporaries, e.g. gathered FSDP shards or dtype casts) is unmapped by the
  receivers before they acknowledge the last bucket of the push;
- a tensor this path cannot share (CPU, another GPU, non-contiguous, memory from
  ``expandable_segments``, which ``cuIpcGetMemHandle`` refuses) makes the session pack that
  bucket into the transport's IPC-shared slot instead, as before.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...errors import WeightSyncError
from ..recent import Recent

logger = logging.getLogger("rollout_engines.weights")

#: Descriptions kept per bucket: a trainer alternating between two weight sets it keeps (as
#: ``bench push`` does) sends each set's description unchanged, and receivers find their views
#: of it (and their copy graphs) again.
DESCRIBED_SETS = 2


def _driver() -> Any | None:
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


def available() -> bool:
    """Whether the zero-copy path can run here (``cuda-bindings`` installed, a CUDA device)."""
    return torch.cuda.is_available() and _driver() is not None


def _ok(result: Any, what: str) -> Any:
    """cuda-bindings returns ``(CUresult, *values)``; raise on an error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise OSError(f"{what} failed: {err!r}")
    return values[0] if len(values) == 1 else values


def _ensure_context(index: int) -> None:
    """Driver calls need the device's primary context current in this thread (worker threads of
    an asyncio loop have none until they make a runtime call)."""
    drv = _driver()
    assert drv is not None
    ctx = _ok(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if not int(ctx):
        dev = _ok(drv.cuDeviceGet(index), "cuDeviceGet")
        _ok(drv.cuCtxSetCurrent(_ok(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")), "cuCtxSetCurrent")


def _handle_bytes(reserved: Any) -> bytes:
    """``CUipcMemHandle.reserved`` as bytes (bindings give bytes or a list of C chars)."""
    if isinstance(reserved, bytes | bytearray):
        return bytes(reserved)
    return bytes(int(b) & 0xFF for b in reserved)


def _make_handle(drv: Any, raw: bytes) -> Any:
    handle = drv.CUipcMemHandle()
    try:
        handle.reserved = raw
    except (TypeError, ValueError, OverflowError):  # bindings that want signed chars
        handle.reserved = [b - 256 if b > 127 else b for b in raw]
    return handle


def _use_count(t: torch.Tensor) -> int:
    try:
        return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))
    except Exception:
        return 0


def lives_on(t: torch.Tensor) -> bool:
    """Whether the trainer surely keeps this tensor's memory after the push (a parameter, a view
    of a storage someone else holds): then keeping its segment mapped costs no memory. The
    storage's use count is 2 for a tensor nobody else holds (the tensor and the query's
    temporary storage object)."""
    return isinstance(t, torch.nn.Parameter) or _use_count(t) > 2


class SegmentExporter:
    """Trainer side: describes tensors as (segment, offset) and keeps what receivers map alive."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.failed: str | None = None if available() else "cuda-bindings is not installed"
        # Segments that stay mapped between pushes: base -> (size, handle, a tensor in it).
        self._kept: dict[int, tuple[int, bytes, torch.Tensor]] = {}
        self._bases: list[int] = []
        # Kept segments the trainer let go of: receivers unmap them during the next push.
        self._releasing: dict[int, tuple[int, bytes, torch.Tensor]] = {}
        self._close_in: int | None = None  # the bucket of this push that carries the unmap list
        # Tensor objects pushed before (weakly): the same object pushed again lives on.
        self._seen: dict[int, weakref.ref[torch.Tensor]] = {}
        # Per bucket index: the last descriptions (most recent first, at most DESCRIBED_SETS),
        # each with its tensors (weakly, with their pointers) and segment bases; reused while the
        # same tensors come back in segments still kept.
        self._described: dict[int, Recent[tuple[list[tuple[weakref.ref[torch.Tensor], int]], dict[str, Any], list[int]]]] = {}

    def _persistent(self, t: torch.Tensor) -> bool:
        ref = self._seen.get(id(t))
        if ref is not None and ref() is t:
            return True
        try:
            self._seen[id(t)] = weakref.ref(t)
        except TypeError:
            pass
        return lives_on(t)

    def _segment(self, ptr: int) -> tuple[int, int, bytes]:
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0:
            base = self._bases[i]
            size, handle, _ = self._kept[base]
            if ptr < base + size:
                return base, size, handle
        drv = _driver()
        assert drv is not None
        base, size = _ok(drv.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
        handle = _ok(drv.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
        return int(base), int(size), _handle_bytes(handle.reserved)

    def describe(self, index: int, tensors: Sequence[torch.Tensor]) -> dict[str, Any] | None:
        """The bucket's tensors as ``{"segments": [[hex handle, size, keep], ...], "refs": [[segment,
        offset], ...], "close": [hex handle, ...]}``, or ``None`` when one of them cannot be
        shared this way."""
        if self.failed is not None:
            return None
        reused = self._reuse(index, tensors)
        if reused is not None:
            return self._with_close(index, reused)
        for t in tensors:
            if t.device != self.device or not t.is_contiguous() or t.numel() == 0:
                return None
        try:
            _ensure_context(self.device.index or 0)
            position: dict[int, int] = {}
            segments: list[list[Any]] = []
            refs: list[list[int]] = []
            for t in tensors:
                ptr = t.data_ptr()
                base, size, handle = self._segment(ptr)
                if base not in position:
                    position[base] = len(segments)
                    segments.append([handle.hex(), size, base in self._kept, base])
                seg = position[base]
                if not segments[seg][2] and self._persistent(t):
                    segments[seg][2] = True
                    self._kept[base] = (size, handle, t)
                    bisect.insort(self._bases, base)
                refs.append([seg, ptr - base])
        except OSError as exc:
            # e.g. expandable segments (cuIpcGetMemHandle refuses virtual-memory allocations)
            self.failed = str(exc)
            logger.info("cuda_ipc: sharing the trainer's tensors directly is not possible (%s); packing buckets", exc)
            return None
        desc: dict[str, Any] = {"segments": segments, "refs": refs, "pid": os.getpid()}
        if all(seg[2] for seg in segments):
            try:
                entry = ([(weakref.ref(t), t.data_ptr()) for t in tensors], desc, list(position))
            except TypeError:
                pass
            else:
                self._described.setdefault(index, Recent(DESCRIBED_SETS)).add(entry)
        return self._with_close(index, desc)

    def _reuse(self, index: int, tensors: Sequence[torch.Tensor]) -> dict[str, Any] | None:
        """A recent description of bucket ``index`` that holds the very same tensors, at the same
        addresses, in segments still kept (a steady push, or one of two weight sets the trainer
        alternates between: no driver call, no lookups, the same description object)."""
        kept = self._described.get(index)
        if kept is None:
            return None

        def holds(entry: tuple[list[tuple[weakref.ref[torch.Tensor], int]], dict[str, Any], list[int]]) -> bool:
            refs, _, bases = entry
            if len(refs) != len(tensors) or any(b not in self._kept for b in bases):
                return False
            for (ref, ptr), t in zip(refs, tensors, strict=True):
                held = ref()
                if held is None or held is not t or held.data_ptr() != ptr:
                    return False
            return True

        hit = kept.find(holds)
        return None if hit is None else hit[1]

    def _with_close(self, index: int, desc: dict[str, Any]) -> dict[str, Any]:
        if self._releasing and self._close_in is None:
            self._close_in = index
            return {**desc, "close": [h.hex() for _, h, _ in self._releasing.values()]}
        return desc

    def unmapping(self) -> bool:
        """Whether this push told receivers to unmap segments (the sender lets go once they did)."""
        return self._close_in is not None

    def begin_push(self) -> None:
        self._close_in = None

    def acked(self, index: int) -> None:
        if index == self._close_in:
            self._releasing.clear()  # every receiver unmapped them

    def end_push(self) -> None:
        """After a push: segments whose tensors only this exporter still holds are released next time."""
        for base in list(self._kept):
            t = self._kept[base][2]
            # Only ours: the dict's tuple, this frame's local and getrefcount's argument hold the
            # object, and the storage has no other tensor (use count 2: ours and the query's).
            if sys.getrefcount(t) <= 3 and _use_count(t) <= 2:
                self._releasing[base] = self._kept.pop(base)
        self._bases = sorted(self._kept)
        self._seen = {k: r for k, r in self._seen.items() if r() is not None}

    def close(self) -> None:
        self._kept, self._releasing, self._bases, self._seen, self._described = {}, {}, [], {}, {}


def steady(desc: dict[str, Any]) -> bool:
    """Whether views of this description may be kept for the next push: every segment is one the
    trainer keeps (so it stays mapped) and the description closes none."""
    return not desc.get("close") and all(seg[2] for seg in desc["segments"])


class SegmentImporter:
    """Engine-worker side: maps the trainer's segments (once) and builds tensor views on them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.opened = 0
        self.closed = 0  # mappings closed so far: views made before a close may be stale
        self._maps: dict[str, tuple[int, torch.Tensor]] = {}  # hex handle -> (pointer, uint8 tensor)
        self._views: dict[tuple[str, int, str, tuple[int, ...]], torch.Tensor] = {}
        self._seen_now: set[str] = set()
        self._keep_now: set[str] = set()
        # bucket index -> the last descriptions whose segments the trainer keeps (most recent
        # first, at most DESCRIBED_SETS): (description JSON, views, segments), within one layout
        self._by_desc: dict[int, Recent[tuple[str, list[torch.Tensor], list[str]]]] = {}
        self._layout: object = None

    def _open(self, handle_hex: str, size: int, local_base: int | None) -> torch.Tensor:
        have = self._maps.get(handle_hex)
        if have is not None:
            return have[1]
        if local_base is not None:
            # The trainer is this process (an engine hosted beside it): its pointer is valid here,
            # and CUDA refuses to open a process's own IPC handle. Nothing to close later.
            tensor = torch.as_tensor(_DeviceArray(local_base, size), device=self.device)
            self._maps[handle_hex] = (0, tensor)
            return tensor
        drv = _driver()
        if drv is None:
            raise WeightSyncError(
                "cuda_ipc: the trainer shares its tensors directly, but this worker lacks cuda-bindings; "
                "install it (pip install 'rollout-engines[cuda]') or connect with options={'direct': False}"
            )
        _ensure_context(self.device.index or 0)
        handle = _make_handle(drv, bytes.fromhex(handle_hex))
        flags = drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        ptr = int(_ok(drv.cuIpcOpenMemHandle(handle, flags), "cuIpcOpenMemHandle"))
        tensor = torch.as_tensor(_DeviceArray(ptr, size), device=self.device)
        self._maps[handle_hex] = (ptr, tensor)
        self.opened += 1
        return tensor

    def begin(self) -> None:
        self._seen_now, self._keep_now = set(), set()

    def views_of(
        self, raw: str, index: int, layout: object, placements: Callable[[], Sequence[Any]]
    ) -> list[torch.Tensor]:
        """:meth:`views` of the description ``raw`` (JSON) for bucket ``index`` of ``layout`` (the
        manifest's tensor list, by identity). A steady push sends the same description every time:
        its views are built once and reused while every segment they lie in stays mapped."""
        if layout is not self._layout:  # views are per layout: drop the last layout's
            self._by_desc.clear()
            self._layout = layout
        known = self._by_desc.setdefault(index, Recent(DESCRIBED_SETS))
        hit = known.find(lambda entry: entry[0] == raw)
        if hit is not None:
            self._seen_now.update(hit[2])
            self._keep_now.update(hit[2])
            return hit[1]
        desc = json.loads(raw)
        views = self.views(desc, placements())
        if steady(desc):
            known.add((raw, views, [seg[0] for seg in desc["segments"]]))
        return views

    def views(self, desc: dict[str, Any], placements: Sequence[Any]) -> list[torch.Tensor]:
        """One view per placement (the manifest's dtype and shape) on the trainer's memory."""
        from ..buckets import torch_dtype

        for handle_hex in desc.get("close", ()):
            if handle_hex in self._maps:
                self._close(handle_hex)
        segments, refs = desc["segments"], desc["refs"]
        if len(refs) != len(placements):
            raise WeightSyncError(f"cuda_ipc: {len(refs)} tensor references for {len(placements)} tensors")
        local = desc.get("pid") == os.getpid()
        for seg in segments:
            self._seen_now.add(seg[0])
            if seg[2]:
                self._keep_now.add(seg[0])
        out = []
        for (index, offset), p in zip(refs, placements, strict=True):
            handle_hex, size, _, base = segments[index]
            key = (handle_hex, offset, p.dtype, tuple(p.shape))
            view = self._views.get(key)
            if view is None:
                if offset + p.nbytes > size:
                    raise WeightSyncError(f"cuda_ipc: tensor '{p.name}' lies outside its shared segment")
                flat = self._open(handle_hex, size, base if local else None)[offset : offset + p.nbytes]
                view = self._views[key] = flat.view(torch_dtype(p.dtype)).view(p.shape)
            out.append(view)
        return out

    def finish(self) -> None:
        """Before the last acknowledgement: unmap this push's segments the trainer does not keep."""
        for handle_hex in self._seen_now - self._keep_now:
            if handle_hex in self._maps:
                self._close(handle_hex)

    def _close(self, handle_hex: str) -> None:
        ptr, _ = self._maps.pop(handle_hex)
        self.closed += 1
        self._views = {k: v for k, v in self._views.items() if k[0] != handle_hex}
        self._by_desc.clear()  # no view may outlive the mapping it lies in
        drv = _driver()
        if drv is not None and ptr:  # 0: this process's own memory, never opened
            try:
                torch.cuda.current_stream(self.device).synchronize()
                _ok(drv.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")
            except OSError:
                logger.debug("cuIpcCloseMemHandle failed", exc_info=True)

    def close(self) -> None:
        for handle_hex in list(self._maps):
            self._close(handle_hex)


class _DeviceArray:
    """Raw device memory presented through ``__cuda_array_interface__`` (zero-copy into torch)."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }
