"""How steady the host CPU is: the same small Python loop timed back to back and after pauses.

A push's CPU-bound phases (the trainer's describe and publish of a bucket, the worker's copy-plan
replay, thread hand-offs) take ~2 ms of a ~1B push; when the host's CPU speed drifts, they drift
with it, and so do push figures from run to run on one machine. This probe prints one JSON line:

- ``hot_loop_us``: the loop's median time, run back to back;
- ``after_<pause>s_loop_us``: after each pause (``--pauses``), the first run, the second, and one
  after 2 ms of spinning (a frequency ramp shows as a slow first run that the spin fixes);
- ``thread_wake_us``: one thread waking another through a ``threading.Event``, back to back and
  after the longest pause.

Run it several times in one go (``--rounds``): the spread of ``hot_loop_us`` across rounds is the
drift. ``bench push`` and ``bench weight-sync`` sample the same loop during a run (``host_loop_us``).
``python benchmarks/cpu_drift.py --rounds 3``
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from rollout_engines.bench.common import python_loop_s as loop_s  # what bench push samples too


def wake_s() -> float:
    """Seconds from one thread's ``Event.set()`` to the waiting thread running."""
    event, woke = threading.Event(), []

    def waiter() -> None:
        event.wait()
        woke.append(time.perf_counter())

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.001)
    t = time.perf_counter()
    event.set()
    thread.join()
    return woke[0] - t


def _us(values: list[float]) -> float:
    return round(statistics.median(values) * 1e6, 1)


def probe(pauses: list[float], repeats: int = 8) -> dict[str, object]:
    out: dict[str, object] = {}
    hot = [loop_s() for _ in range(4 * repeats + 20)]
    out["hot_loop_us"] = _us(hot[20:])  # after a warm-up
    for pause in pauses:
        first, second, spun = [], [], []
        for _ in range(repeats):
            time.sleep(pause)
            first.append(loop_s())
            second.append(loop_s())
            t = time.perf_counter()
            while time.perf_counter() - t < 0.002:
                pass
            spun.append(loop_s())
        out[f"after_{pause:g}s_loop_us"] = [_us(first), _us(second), _us(spun)]
    wakes = [wake_s() for _ in range(4 * repeats)]
    late = []
    for _ in range(repeats):
        time.sleep(max(pauses, default=0.0))
        late.append(wake_s())
    out["thread_wake_us"] = {"back_to_back": _us(wakes), f"after_{max(pauses, default=0.0):g}s": _us(late)}
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pauses", default="0.01,0.1,0.5", help="comma-separated seconds")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args(argv)
    pauses = [float(p) for p in args.pauses.split(",") if p]
    if any(not p >= 0 for p in pauses):
        parser.error(f"--pauses must be seconds >= 0, got {args.pauses!r}")
    rounds = [probe(pauses, max(1, args.repeats)) for _ in range(max(1, args.rounds))]
    hot = [r["hot_loop_us"] for r in rounds]
    result = {"rounds": rounds, "hot_loop_us_min": min(hot), "hot_loop_us_max": max(hot)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
