"""How fast a GPU copies a state dict into separate tensors, by method; one JSON line.

    python benchmarks/copy_kernels.py [--size-mb 3072] [--tensors 320] [--buckets 12]
    python benchmarks/copy_kernels.py --shape qwen3-14b [--bucket-mb 2048]
    python benchmarks/copy_kernels.py --shape medium      # RESULTS.md's $MEDIUM (~1B, 195 tensors)

The limit under a receiver that copies into an engine's parameters: one flat copy of the same
bytes (the ``bench weight-sync`` baseline), ``torch._foreach_copy_`` eager and replayed from a
CUDA graph, the same split over several streams inside one graph, a graph of one copy node per
tensor, the core's chunked Triton kernel (``rollout_engines.weights._chunk_copy``) with a few shapes, and the core's
``SteadyCopier`` with each of its kernels. ``bucketed``
entries do the same per bucket (``--buckets`` graphs or launches in a row, as a receiver copies
bucket by bucket). Best of 7, GB/s of payload; a method that fails reports its error.

``--shape`` copies the bf16 tensors of a named model shape (:mod:`rollout_engines.testing.shapes`,
Qwen2 form: what ``bench push --model`` moves for a checkpoint of that shape) in buckets of
``--bucket-mb``, with the copier's kernels only: large tensors are where one multi-tensor copy
and one memcpy per tensor differ.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rollout_engines.testing.shapes import Shape

Tensors = Sequence[torch.Tensor]


def best_seconds(fn: Callable[[], object], repeats: int = 7) -> float:
    fn()  # warm-up (compiles, first launches)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def graph_of(body: Callable[[], object]) -> Callable[[], object]:
    body()  # warm-up outside the capture (Triton compiles here)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g.replay


def on_streams(streams: int, dst: Tensors, src: Tensors, per_stream: Callable[[Tensors, Tensors], object]) -> Callable[[], None]:
    side = [torch.cuda.Stream() for _ in range(streams)]

    def body() -> None:
        cur = torch.cuda.current_stream()
        for k, s in enumerate(side):
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                per_stream(dst[k::streams], src[k::streams])
        for s in side:
            cur.wait_stream(s)

    return body


def per_tensor(dst: Tensors, src: Tensors) -> None:
    for a, b in zip(dst, src, strict=True):
        a.copy_(b, non_blocking=True)


def foreach(dst: Tensors, src: Tensors) -> None:
    torch._foreach_copy_(list(dst), list(src), non_blocking=True)


def chunk_kernel(dst: Tensors, src: Tensors, chunk: int, block: int, warps: int) -> Callable[[], None]:
    from rollout_engines.weights import _chunk_copy

    table = _chunk_copy.plan(dst, src, chunk_bytes=chunk)
    assert table is not None
    return lambda: _chunk_copy.launch(table, chunk_bytes=chunk, block=block, num_warps=warps)


def copier(kernel: str, buckets: Sequence[tuple[Tensors, Tensors]], *, graphs: bool = True,
           memcpy_min_mb: float | None = None) -> Callable[[], None]:
    """The core's copier, bucket by bucket (``graphs=False``: its eager copies, what a receiver does
    with tensors it has not seen before)."""
    from rollout_engines.weights.copies import SteadyCopier

    c = SteadyCopier(kernel=kernel, graphs=graphs)
    if memcpy_min_mb is not None:
        c.memcpy_min_bytes = int(memcpy_min_mb * 2**20)
    for _ in range(2):  # seen, then captured: from here on every call replays
        for d, s in buckets:
            c.copy(d, s)
    return lambda: [c.copy(d, s) for d, s in buckets] and None


def per_bucket(buckets: Sequence[tuple[Tensors, Tensors]],
               make: Callable[[Tensors, Tensors], Callable[[], object]]) -> Callable[[], None]:
    """One run per bucket (``make(dsts, srcs)``), all of them in a row."""
    runs = [make(d, s) for d, s in buckets]
    return lambda: [r() for r in runs] and None


def measure(methods: dict[str, Callable[[], Callable[[], object]]], dst: Tensors, src: Tensors, nbytes: int,
            out: dict[str, object]) -> None:
    for name, make in methods.items():
        try:
            for t in dst:
                t.zero_()
            fn = make()
            seconds = best_seconds(fn)
            ok = all(torch.equal(a, b) for a, b in zip(dst, src, strict=True)) if name != "flat_copy" else True
            out[name] = {"seconds": round(seconds, 6), "gbps": round(nbytes / seconds / 1e9, 1), "correct": ok}
        except Exception as exc:  # report and go on: one method's failure is a result too
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def medium_shape() -> Shape:
    """The shape of RESULTS.md's ``$MEDIUM`` checkpoint (not a Qwen3 card: a small vocabulary)."""
    from rollout_engines.testing.shapes import Shape

    return Shape(hidden=2048, layers=16, heads=16, kv_heads=4, head_dim=128, intermediate=8192,
                 tie_word_embeddings=False, vocab_size=1024)


def shape_main(name: str, bucket_mb: float) -> None:
    """The tensors of a named shape, as slices of one flat buffer each side (256-byte aligned)."""
    from rollout_engines.testing.shapes import SHAPES, tensor_shapes

    dev = torch.device("cuda", 0)
    shapes = [s for _, s in tensor_shapes(medium_shape() if name == "medium" else SHAPES[name], qwen3=False)]
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // 128) * 128  # 256 bytes of bf16
    flat_src = torch.empty(end, dtype=torch.bfloat16, device=dev).normal_()
    flat_dst = torch.empty(end, dtype=torch.bfloat16, device=dev)
    src = [flat_src[o:o + n].view(s) for o, n, s in zip(offsets, sizes, shapes, strict=True)]
    dst = [flat_dst[o:o + n].view(s) for o, n, s in zip(offsets, sizes, shapes, strict=True)]
    limit = int(bucket_mb * 2**20)
    buckets: list[tuple[Tensors, Tensors]] = []
    start, used = 0, 0
    for i, n in enumerate(sizes):
        if used and used + 2 * n > limit:
            buckets.append((dst[start:i], src[start:i]))
            start, used = i, 0
        used += 2 * n
    buckets.append((dst[start:], src[start:]))

    methods: dict[str, Callable[[], Callable[[], object]]] = {
        "flat_copy": lambda: lambda: flat_dst.copy_(flat_src),
        "per_tensor_eager": lambda: lambda: per_tensor(dst, src),
        "bucketed_per_tensor_graph": lambda: per_bucket(buckets, lambda d, s: graph_of(lambda: per_tensor(d, s))),
    }
    for kernel in ("foreach", "streams"):
        methods[f"copier_{kernel}_bucketed"] = lambda kernel=kernel: copier(kernel, buckets)
    for min_mb in (4, 16, 64):
        methods[f"copier_hybrid{min_mb}mb_bucketed"] = lambda m=min_mb: copier("hybrid", buckets, memcpy_min_mb=m)
    methods["copier_eager_bucketed"] = lambda: copier("hybrid", buckets, graphs=False)
    nbytes = 2 * sum(sizes)
    out: dict[str, object] = {"shape": name, "bytes": nbytes, "tensors": len(sizes), "buckets": len(buckets),
                              "device": torch.cuda.get_device_name(dev)}
    measure(methods, dst, src, nbytes, out)
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=float, default=3072)
    parser.add_argument("--tensors", type=int, default=320)
    parser.add_argument("--buckets", type=int, default=12)
    parser.add_argument("--shape", default=None,
                        help="a named shape of rollout_engines.testing.shapes, or 'medium' (RESULTS.md's $MEDIUM)")
    parser.add_argument("--bucket-mb", type=float, default=2048, help="bucket size with --shape")
    args = parser.parse_args()
    if args.shape:
        shape_main(args.shape, args.bucket_mb)
        return
    dev = torch.device("cuda", 0)
    n = args.tensors
    per = int(args.size_mb * 2**20) // 4 // n // 4 * 4  # whole 16-byte words, as parameters are
    src = [torch.randn(per, device=dev) for _ in range(n)]
    dst = [torch.empty(per, device=dev) for _ in range(n)]
    flat_src, flat_dst = torch.empty(n * per, device=dev), torch.empty(n * per, device=dev)
    size = -(-n // args.buckets)
    buckets = [(dst[i:i + size], src[i:i + size]) for i in range(0, n, size)]

    def bucketed(make: Callable[[Tensors, Tensors], Callable[[], object]]) -> Callable[[], None]:
        return per_bucket(buckets, make)

    methods: dict[str, Callable[[], Callable[[], object]]] = {
        "flat_copy": lambda: lambda: flat_dst.copy_(flat_src),
        "foreach_eager": lambda: lambda: foreach(dst, src),
        "foreach_graph": lambda: graph_of(lambda: foreach(dst, src)),
        "per_tensor_graph": lambda: graph_of(lambda: per_tensor(dst, src)),
        "per_tensor_eager": lambda: lambda: per_tensor(dst, src),
        "bucketed_foreach_graph": lambda: bucketed(lambda d, s: graph_of(lambda: foreach(d, s))),
    }
    for k in (2, 4):
        methods[f"foreach_graph_{k}streams"] = lambda k=k: graph_of(on_streams(k, dst, src, foreach))
    methods["bucketed_foreach_graph_4streams"] = lambda: bucketed(lambda d, s: graph_of(on_streams(4, d, s, foreach)))
    for chunk, block, warps in ((1 << 20, 2048, 8), (1 << 18, 2048, 8), (1 << 16, 2048, 8), (1 << 20, 4096, 8),
                                (1 << 18, 4096, 16), (1 << 18, 1024, 4)):
        tag = f"chunk{chunk >> 10}k_b{block}_w{warps}"
        methods[f"{tag}_graph"] = lambda c=chunk, b=block, w=warps: graph_of(chunk_kernel(dst, src, c, b, w))
    methods["bucketed_chunk1024k_graph"] = lambda: bucketed(lambda d, s: graph_of(chunk_kernel(d, s, 1 << 20, 2048, 8)))
    methods["bucketed_chunk256k_graph"] = lambda: bucketed(lambda d, s: graph_of(chunk_kernel(d, s, 1 << 18, 2048, 8)))
    for kernel in ("foreach", "streams", "chunks"):  # what a receiver runs: the core's copier, bucket by bucket
        methods[f"copier_{kernel}_bucketed"] = lambda kernel=kernel: copier(kernel, buckets)
    nbytes = n * per * 4
    out: dict[str, object] = {"bytes": nbytes, "tensors": n, "buckets": len(buckets),
                              "device": torch.cuda.get_device_name(dev)}
    measure(methods, dst, src, nbytes, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
