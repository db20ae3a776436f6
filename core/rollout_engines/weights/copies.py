"""Copying received tensors into a model's: fast when the same tensors come back every update.

A zero-copy ``cuda_ipc`` push hands a receiver the same views of the trainer's memory every update,
and an engine copies them into the same parameters. :class:`SteadyCopier` notices that and, from
the second time on, replays the bucket's copies as a CUDA graph: one launch, and the copy kernels
run faster replayed than launched eagerly. By default the graph holds the bucket's multi-tensor
copy split over four side streams: one ``_foreach_copy_`` leaves the GPU idle at the tail of each
of its launches, four in parallel fill each other's (on an H200, 12 buckets of 27 tensors of
9.6 MiB: 1832 GB/s with four streams, 1668 GB/s with one, 1705 GB/s with the chunked Triton kernel
of :mod:`._chunk_copy`, against 2054 GB/s for one flat copy of the same bytes; see
benchmarks/RESULTS.md), with tensors of 16 MiB and more (``ROLLOUT_ENGINES_MEMCPY_MIN_MB``) copied
one memcpy each (``kernel="hybrid"``, the default: a 14B model's tensors at 1992 GB/s, against 1907
with four streams alone and 1499 with one multi-tensor copy). ``kernel="streams"``, ``"foreach"``
or ``"chunks"`` (or ``ROLLOUT_ENGINES_COPY_KERNEL``) replays those instead.

Anything else (tensors seen for the first time, e.g. a trainer that hands over new tensors every
update, or a capture that fails) is copied eagerly: large tensors one memcpy each, the rest in one
``_foreach_copy_`` (CPU tensors: all of them).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Sequence

import torch

from . import _chunk_copy

logger = logging.getLogger("rollout_engines.weights")

#: Side streams of a "streams" copy.
STREAMS = 4

_Fingerprint = list[tuple[weakref.ref[torch.Tensor], int]]


def _fingerprint(tensors: Sequence[torch.Tensor]) -> _Fingerprint | None:
    try:
        return [(weakref.ref(t), t.data_ptr()) for t in tensors]
    except TypeError:
        return None


def _same(fingerprint: _Fingerprint, tensors: Sequence[torch.Tensor]) -> bool:
    """The very same tensor objects, still at the same addresses (a graph replays addresses)."""
    if len(fingerprint) != len(tensors):
        return False
    for (ref, ptr), t in zip(fingerprint, tensors, strict=True):
        if t.data_ptr() != ptr or ref() is not t:
            return False
    return True


class SteadyCopier:
    """``copy(dsts, srcs)``: ``dst.copy_(src)`` for each pair (same shapes and dtypes), as one
    multi-tensor copy, replayed from a CUDA graph once the same pairs come back. ``graphs=False``
    always copies eagerly."""

    def __init__(self, *, graphs: bool = True, max_graphs: int = 1024, kernel: str | None = None) -> None:
        self.use_graphs = graphs
        self.max_graphs = max_graphs
        #: What a graph replays: "chunks" (one chunked kernel, where it applies), "streams" (multi-
        #: tensor copies on parallel streams), "hybrid" ("streams" with large tensors copied one
        #: by one) or "foreach" (one multi-tensor copy).
        self.kernel = kernel or os.environ.get("ROLLOUT_ENGINES_COPY_KERNEL", "hybrid")
        #: Tensors of at least this many bytes are copied one by one (a memcpy each, at the
        #: flat-copy rate), smaller ones as multi-tensor copies: in eager copies, and in the graphs
        #: of ``kernel="hybrid"`` (the default; "streams" for the rest).
        self.memcpy_min_bytes = int(float(os.environ.get("ROLLOUT_ENGINES_MEMCPY_MIN_MB", "16")) * 2**20)
        self.replays = 0  # graph replays so far (tests and benchmarks read it)
        self.chunked = 0  # graphs captured with the chunked kernel
        # key (ids of every tensor) -> (fingerprint, graph or None when seen once so far, what the
        # graph reads besides the tensors)
        self._known: dict[tuple[int, ...], tuple[_Fingerprint, torch.cuda.CUDAGraph | None, object]] = {}
        self._streams: list[torch.cuda.Stream] = []

    def forget(self) -> None:
        """Drop every captured graph (the tensors they copy are going away)."""
        self._known.clear()

    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if not dsts:
            return
        if not (self.use_graphs and dsts[0].is_cuda):
            self._eager(dsts, srcs)
            return
        tensors = [*dsts, *srcs]
        key = tuple(map(id, tensors))
        known = self._known.get(key)
        if known is not None and _same(known[0], tensors):
            if known[1] is not None:
                known[1].replay()
                self.replays += 1
                return
            graph, table = self._capture(dsts, srcs)  # the second time: steady, worth a graph
            if graph is not None:
                self._known[key] = (known[0], graph, table)
                graph.replay()  # capturing recorded the copies without running them
                self.replays += 1
                return
        else:
            fingerprint = _fingerprint(tensors)
            if fingerprint is not None:
                if len(self._known) >= self.max_graphs:
                    self._known.clear()
                self._known[key] = (fingerprint, None, None)
        self._eager(dsts, srcs)

    def _eager(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        """The copies launched one by one where they are large (on CUDA, at least
        ``memcpy_min_bytes``: a memcpy each, at the flat-copy rate; one multi-tensor copy is ~0.75
        of it on an H200), the rest as one multi-tensor copy."""
        _copy_mixed(dsts, srcs, self.memcpy_min_bytes if dsts[0].is_cuda else None)

    def _capture(
        self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]
    ) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]:
        table = None
        if self.kernel == "chunks" and _chunk_copy.available():
            table = _chunk_copy.plan(dsts, srcs)
            if table is not None:
                try:
                    _chunk_copy.launch(table)  # compiles once per process, outside any capture
                except Exception as exc:
                    logger.info("the chunked copy kernel failed (%s); replaying foreach copies", exc)
                    self.kernel, table = "foreach", None
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                if table is not None:
                    _chunk_copy.launch(table)
                elif self.kernel == "hybrid" or (self.kernel == "streams" and len(dsts) > 1):
                    self._foreach_on_streams(dsts, srcs)
                else:
                    torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)
        except Exception as exc:  # a graph is an optimisation: copy eagerly from now on
            logger.info("CUDA graph capture of weight copies failed (%s); copying eagerly", exc)
            self.use_graphs = False
            return None, None
        if table is not None:
            self.chunked += 1
        return graph, table

    def _foreach_on_streams(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        """The copies as ``STREAMS`` multi-tensor copies on side streams (forked from and joined to
        the current stream, so a graph captures them as parallel branches): one foreach launch
        leaves the GPU idle at its tail, several in parallel fill each other's."""
        cur = torch.cuda.current_stream()
        if len(self._streams) < STREAMS:
            self._streams = [torch.cuda.Stream(device=cur.device) for _ in range(STREAMS)]
        loads = [0] * STREAMS
        groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in range(STREAMS)]
        for i in sorted(range(len(dsts)), key=lambda i: -dsts[i].numel() * dsts[i].element_size()):
            k = loads.index(min(loads))  # the least loaded stream takes the next largest copy
            groups[k][0].append(dsts[i])
            groups[k][1].append(srcs[i])
            loads[k] += dsts[i].numel() * dsts[i].element_size()
        big = self.memcpy_min_bytes if self.kernel == "hybrid" else None
        for stream, (d, s) in zip(self._streams, groups, strict=False):
            if d:
                stream.wait_stream(cur)
                with torch.cuda.stream(stream):
                    _copy_mixed(d, s, big)
        for stream, (d, _) in zip(self._streams, groups, strict=False):
            if d:
                cur.wait_stream(stream)


def _copy_mixed(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], big: int | None) -> None:
    """``dst.copy_(src)`` for each pair: those of at least ``big`` bytes one by one (contiguous, same
    dtype: a memcpy each, a memcpy node in a graph), the rest as one multi-tensor copy (all of
    them where ``big`` is None)."""
    if big is None:
        torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)
        return
    small_d: list[torch.Tensor] = []
    small_s: list[torch.Tensor] = []
    for d, s in zip(dsts, srcs, strict=True):
        if d.numel() * d.element_size() >= big:
            d.copy_(s, non_blocking=True)
        else:
            small_d.append(d)
            small_s.append(s)
    if small_d:
        torch._foreach_copy_(small_d, small_s, non_blocking=True)
