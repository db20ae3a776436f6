"""`rollout-engines bench async --backend B --json`: the engine under an async-RL load.

Three measurements on one engine:

- **Throughput with pushes**: the same requests (fixed prompts, greedy, fixed length) run twice
  with ``--concurrency`` streams in flight all the time: once without weight pushes, once with a
  push every ``--push-every`` steps (a step is ``--step-requests`` finished requests, as a trainer
  would consume them), each inside ``pause("keep")`` / ``resume()`` so running requests continue
  under the new weights. Reported: tokens/s of both, their ratio, the pushes made and how many
  completions span two weight versions.
- **idle_fraction** of each run: the fraction of wall time the engine stepped no request while
  requests were waiting, from the engine's own state (:class:`EngineSampler`; where the backend
  does not report it, from the deltas' time stamps). ``stall_fraction`` is the deltas' view
  (:class:`IdleMeter`): time beyond one step with no token delivered, prefills included.
  ``paused_fraction`` / ``held_fraction``: the seconds the engine itself counted paused
  (``info().paused_s``) / holding generation (``info().held_s``: paused, or applying an update
  that stops generation, as vLLM's and SGLang's do) during the push run, over its wall time;
  ``engine_samples``: how many ``info()`` samples the idle figure rests on.
- **Abort latency**: ``--aborts`` running requests (each has streamed a token; ``--concurrency``
  - 1 other requests keep the engine busy) are aborted one at a time; the latency is from the
  ``abort()`` call to the arrival of the request's last delta (``finish_reason="abort"``).
  Reported: median and p99 in milliseconds.

The pushed weights alternate between a perturbed copy of the model's checkpoint and the original
(``--transport``, default ``inproc`` where the engine has it).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import math
import random
import statistics
import time
from typing import Any

from ..options import add_option_argument
from ..types import GenerateRequest, SamplingParams


class IdleMeter:
    """When an engine generated nothing while requests were waiting, seen from its output.

    The caller reports each request's start (:meth:`begin`), every delta's arrival
    (:meth:`tokens`) and each request's end (:meth:`end`), under a key of its own per request. A
    streamed request gets one delta per engine step, so the median gap between two deltas of the
    same request is the engine's step time. Within the periods when at least one request was in
    flight, every gap between consecutive deliveries of any request (and from a period's start to
    its first delivery) longer than one step counts, less that step, as idle: the time of a weight
    push inside a pause, of a stall, or of work that produced no token (a prefill, also the one
    after a weight change). ``idle_fraction`` is that idle time over the wall time from the first
    request's start to the last one's end.
    """

    def __init__(self) -> None:
        self.inflight = 0
        self._since = 0.0
        self.first: float | None = None
        self.last = 0.0
        self.busy: list[tuple[float, float]] = []  # periods with requests in flight
        self.deliveries: list[float] = []  # every delta with tokens, in order
        self.step_gaps: list[float] = []  # gaps between two deltas of one request
        self._last_of: dict[Any, float] = {}
        self.token_count = 0

    def begin(self, key: Any) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        if self.inflight == 0:
            self._since = now
        self.inflight += 1
        self._last_of[key] = 0.0

    def tokens(self, key: Any, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        self.token_count += n
        self.deliveries.append(now)
        before = self._last_of.get(key)
        if before:
            self.step_gaps.append(now - before)
        self._last_of[key] = now

    def end(self, key: Any) -> None:
        now = time.perf_counter()
        self._last_of.pop(key, None)
        self.inflight -= 1
        self.last = now
        if self.inflight == 0:
            self.busy.append((self._since, now))

    def result(self) -> dict[str, Any]:
        busy = list(self.busy)
        if self.inflight > 0:
            busy.append((self._since, time.perf_counter()))
        points_all = self.deliveries
        step = statistics.median(self.step_gaps) if self.step_gaps else 0.0
        idle = 0.0
        for a, b in busy:
            lo, hi = bisect.bisect_left(points_all, a), bisect.bisect_right(points_all, b)
            points = [a, *points_all[lo:hi], b]
            idle += sum(max(0.0, y - x - step) for x, y in zip(points, points[1:], strict=False))
        end = busy[-1][1] if busy else self.last
        wall = end - self.first if self.first is not None else 0.0
        return {
            "idle_fraction": round(idle / wall, 4) if wall > 0 else None,
            "idle_s": round(idle, 3), "wall_s": round(wall, 3), "step_ms": round(step * 1e3, 3),
            "tokens": self.token_count,
        }


class EngineSampler:
    """The engine's own view of idleness: ``info()`` sampled every ``interval_s``.

    Time is idle when requests were outstanding (``outstanding()``, the caller's count) and the
    engine worked on none of them: generation was held (frozen by a ``keep`` pause, or stopped by
    a weight update being applied, on backends whose updates stop it: the held seconds the engine
    counts, ``info().held_s``, so holds shorter than the sampling interval count too), or it had
    taken no request (no running request, row or row waiting to be prefilled: it was
    applying weights, or waited for the caller). Prefills count as work, the re-prefill of kept
    rows after a push included (the deltas' view, :class:`IdleMeter`, counts them as stalls). Needs a backend that reports
    ``running_rows`` (and ``running``, ``pending_rows``, ``frozen``) in ``info().extra``, as the
    transformers engine does; otherwise :meth:`result` is None and :class:`IdleMeter` is the measure.
    """

    def __init__(self, engine: Any, outstanding: Any, interval_s: float = 0.002) -> None:
        self.engine, self.outstanding, self.interval_s = engine, outstanding, interval_s
        self.idle_s = 0.0
        self.wall_s = 0.0
        self.samples = 0
        self.supported: bool | None = None
        self._held_s: float | None = None  # the engine's info().held_s (or paused_s) at the last sample
        self._stop = asyncio.Event()

    async def run(self) -> None:
        last = time.perf_counter()
        while True:
            stopping = self._stop.is_set()  # one more sample after stop(): the last interval counts
            info = await self.engine.info()
            now = time.perf_counter()
            extra = info.extra
            if self.supported is None:
                self.supported = "running_rows" in extra
                if not self.supported:
                    return
            dt, last = now - last, now
            self.wall_s += dt
            self.samples += 1
            # requests taken by the worker (stepped, prefilled, or re-prefilled after a push)
            working = extra.get("running") or extra.get("running_rows") or extra.get("pending_rows")
            frozen = bool(extra.get("frozen")) or info.paused
            held = None
            held_s = info.held_s if info.held_s is not None else info.paused_s
            if held_s is not None:
                # Time held since the last sample, as the engine counted it (paused, or applying an
                # update that stops generation): a pause + push + resume can begin and end between
                # two samples (this loop waits for the event loop), so the state at the sample
                # alone would miss it.
                held = min(dt, max(0.0, held_s - self._held_s)) if self._held_s is not None else 0.0
                self._held_s = held_s
            if self.outstanding() > 0:
                if not frozen and not working:
                    self.idle_s += dt
                elif held is not None:
                    self.idle_s += held
                elif frozen:
                    self.idle_s += dt
            if stopping:
                return
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass

    def stop(self) -> None:
        self._stop.set()

    def result(self) -> float | None:
        if not self.supported or self.wall_s <= 0:
            return None
        return round(self.idle_s / self.wall_s, 4)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="transformers")
    parser.add_argument("--model", default=None, help="model directory (default: the tiny test model)")
    parser.add_argument("--transport", default=None, help="weight transport (default: inproc where the engine has it)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--requests", type=int, default=256, help="requests per throughput run")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--step-requests", type=int, default=64, help="finished requests per trainer step")
    parser.add_argument("--push-every", type=int, default=1, help="push every N steps in the push run")
    parser.add_argument("--aborts", type=int, default=50)
    add_option_argument(parser)


def _requests(args: argparse.Namespace, vocab: int, tag: str) -> list[GenerateRequest]:
    """Fixed prompts, greedy, lengths spread over max_tokens/2 .. 3*max_tokens/2 (requests end at
    different times, as rollouts do, so some are running whenever a push comes)."""
    rng = random.Random(0)
    out = []
    for i in range(args.requests):
        length = rng.randint(max(1, args.max_tokens // 2), max(1, args.max_tokens * 3 // 2))
        out.append(GenerateRequest(
            prompt_token_ids=[[rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)]],
            sampling=SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True), request_ids=[f"{tag}-{i}"]))
    return out


class _Pusher:
    """Pushes alternately perturbed and original weights, each inside a ``keep`` pause."""

    def __init__(self, engine: Any, sync: Any, states: list[dict[str, Any]], version: int) -> None:
        self.engine, self.sync, self.states, self.version = engine, sync, states, version
        self.pushes = 0
        self.pause_s: list[float] = []

    async def push(self) -> None:
        start = time.perf_counter()
        keep = "keep" in self.engine.pause_modes()  # else the push lands between two requests' steps
        if keep:
            await self.engine.pause("keep")
        try:
            self.version += 1
            await self.sync.push(self.states[self.version % 2], version=self.version)
        finally:
            if keep:
                await self.engine.resume()
        self.pushes += 1
        self.pause_s.append(time.perf_counter() - start)


async def _load(engine: Any, requests: list[GenerateRequest], concurrency: int, step_requests: int,
                pusher: _Pusher | None, push_every: int) -> dict[str, Any]:
    """Run ``requests`` with ``concurrency`` streams in flight; push every ``push_every`` steps."""
    meter = IdleMeter()
    slots = asyncio.Semaphore(concurrency)
    done = 0
    spanning = 0
    pushing: asyncio.Task[None] | None = None
    pushes: list[asyncio.Task[None]] = []

    async def one(request: GenerateRequest) -> None:
        nonlocal done, spanning, pushing
        versions: set[int] = set()
        key = request.request_ids[0] if request.request_ids else id(request)
        meter.begin(key)
        try:
            async for delta in engine.stream(request):
                meter.tokens(key, len(delta.token_ids))
                if delta.token_ids:
                    versions.add(delta.weight_version)
        finally:
            meter.end(key)
            slots.release()
        spanning += len(versions) > 1
        done += 1
        if pusher is not None and done % step_requests == 0 and (done // step_requests) % push_every == 0:
            if pushing is None or pushing.done():  # a trainer pushes one update at a time
                pushing = asyncio.ensure_future(pusher.push())
                pushes.append(pushing)

    sampler = EngineSampler(engine, lambda: meter.inflight)
    before = await engine.info()
    sampling = asyncio.ensure_future(sampler.run())
    start = time.perf_counter()
    tasks = []
    for request in requests:
        await slots.acquire()
        tasks.append(asyncio.ensure_future(one(request)))
    await asyncio.gather(*tasks)
    seconds = time.perf_counter() - start
    sampler.stop()
    await asyncio.gather(sampling, *pushes)
    gaps = meter.result()
    engine_idle = sampler.result()
    after = await engine.info()

    def share(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round((b - a) / seconds, 4)

    return {"seconds": seconds, "tokens": meter.token_count, "spanning": spanning, **gaps,
            "paused_fraction": share(before.paused_s, after.paused_s), "held_fraction": share(before.held_s, after.held_s),
            "samples": sampler.samples,
            "stall_fraction": gaps["idle_fraction"],
            "idle_fraction": engine_idle if engine_idle is not None else gaps["idle_fraction"],
            "idle_source": "engine info()" if engine_idle is not None else "delta gaps"}


async def _abort_latency(engine: Any, args: argparse.Namespace, vocab: int) -> list[float]:
    rng = random.Random(1)
    long = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True)

    def prompt() -> list[list[int]]:
        return [[rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)]]

    stop = asyncio.Event()

    async def background(k: int) -> None:  # keeps the engine busy meanwhile
        i = 0
        while not stop.is_set():
            i += 1
            async for _ in engine.stream(GenerateRequest(prompt_token_ids=prompt(), sampling=long,
                                                         request_ids=[f"bg-{k}-{i}"])):
                if stop.is_set():
                    break

    busy = [asyncio.ensure_future(background(k)) for k in range(max(0, args.concurrency - 1))]
    latencies: list[float] = []
    try:
        for i in range(args.aborts):
            rid = f"abort-{i}"
            t0: float | None = None
            async for delta in engine.stream(GenerateRequest(prompt_token_ids=prompt(), sampling=long,
                                                             request_ids=[rid])):
                if delta.finish_reason is not None:
                    if t0 is not None and delta.finish_reason == "abort":
                        latencies.append(time.perf_counter() - t0)
                    break
                if t0 is None and delta.token_ids:  # it runs: abort it
                    t0 = time.perf_counter()
                    await engine.abort([rid])
    finally:
        stop.set()
        if busy:
            await engine.abort_all()
        await asyncio.gather(*busy, return_exceptions=True)
    return latencies


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from ..factory import create_engine
    from ..weights.checkpoint import load_checkpoint, perturbed
    from ..weights.session import connect_weight_sync
    from .common import parse_options, push_weights

    engine = await asyncio.to_thread(create_engine, args.backend, args.model, **parse_options(args))
    try:
        caps = engine.capabilities
        if args.transport is None and "inproc" in caps.transports:
            transport = "inproc"
            original = load_checkpoint(args.model)
            states = [original, perturbed(original)]
        else:  # the engine's dtype, on the device the transport sends from (cuda_ipc on a GPU)
            weights = await push_weights(engine, args.model, args.transport)
            transport, original = weights.transport, weights.original
            states = [original, weights.changed]
        embed = next((t for n, t in original.items() if n.endswith("embed_tokens.weight")), None)
        vocab = int(embed.shape[0]) if embed is not None else 4000
        step_requests = args.step_requests
        sync = await connect_weight_sync([engine], transport)
        try:
            pusher = _Pusher(engine, sync, states, engine.weight_version)
            warm = argparse.Namespace(**{**vars(args), "requests": min(args.requests, args.concurrency)})
            await _load(engine, _requests(warm, vocab, "warm"), args.concurrency, step_requests, pusher, 1)
            pushes_before = pusher.pushes
            plain = await _load(engine, _requests(args, vocab, "plain"), args.concurrency, step_requests, None, 1)
            pusher.pause_s.clear()
            pushed = await _load(engine, _requests(args, vocab, "push"), args.concurrency, step_requests, pusher,
                                 args.push_every)
            pushes = pusher.pushes - pushes_before
            latencies = await _abort_latency(engine, args, vocab)
        finally:
            await sync.close()
    finally:
        await engine.close()
    tps_plain = plain["tokens"] / plain["seconds"]
    tps_push = pushed["tokens"] / pushed["seconds"]
    return {
        "backend": args.backend, "transport": transport, "concurrency": args.concurrency,
        "requests": args.requests, "max_tokens": args.max_tokens, "step_requests": step_requests,
        "push_every": args.push_every,
        "tokens_per_s_no_push": round(tps_plain, 1), "tokens_per_s_push": round(tps_push, 1),
        "push_throughput_ratio": round(tps_push / tps_plain, 3),
        "pushes": pushes, "completions_spanning_updates": pushed["spanning"],
        "pause_push_ms_median": round(statistics.median(pusher.pause_s) * 1e3, 2) if pusher.pause_s else None,
        "idle_fraction": pushed["idle_fraction"], "idle_fraction_no_push": plain["idle_fraction"],
        "idle_source": pushed["idle_source"], "paused_fraction": pushed["paused_fraction"],
        "held_fraction": pushed["held_fraction"],
        "engine_samples": pushed["samples"],
        "stall_fraction": pushed["stall_fraction"], "stall_fraction_no_push": plain["stall_fraction"],
        "step_ms": pushed["step_ms"],
        "aborts": len(latencies),
        "abort_ms_median": round(statistics.median(latencies) * 1e3, 2) if latencies else None,
        "abort_ms_p99": round(_percentile(latencies, 0.99) * 1e3, 2) if latencies else None,
        "abort_ms_max": round(max(latencies) * 1e3, 2) if latencies else None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.model is None:
        from ..testing.tiny_model import tiny_model_path

        args.model = str(tiny_model_path())
    return asyncio.run(_run(args))
