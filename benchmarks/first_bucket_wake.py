"""How soon a slot receiver (``shm``, ``cuda_ipc``) that waits for an update's first bucket sees it
once the trainer publishes it; one JSON line.

    python benchmarks/first_bucket_wake.py [--ahead-s 0.01,0.3] [--pushes 30]

A receiver that starts an update before the trainer has any of it (an engine rung at the push's
start while the trainer still gathers its first bucket) waits. This times, in one process over
the real store and ``shm`` transport, the span from the sender's publish of bucket 0 returning to
the receiver's ``recv_bucket(0)`` returning, for receivers ``--ahead-s`` seconds ahead of the
sender; medians and 90th percentiles in microseconds. Run it with ``PYTHONPATH`` naming another
checkout's ``core`` to compare two versions of the transport.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
from rollout_engines.weights.buckets import BucketHeader, pack_bucket
from rollout_engines.weights.manifest import TransportSpec, WeightManifest, plan_manifest, specs_of
from rollout_engines.weights.transports.shm import ShmReceiver, ShmSender


def _receive(receiver: ShmReceiver, manifest: WeightManifest, got: list[float]) -> None:
    receiver.begin(manifest)
    receiver.recv_bucket(0, manifest.buckets[0].nbytes)
    got.append(time.perf_counter())
    receiver.release(0)
    receiver.end(manifest, ok=True)


def measure(ahead_s: float, pushes: int) -> dict[str, float]:
    sender = ShmSender(session_id=f"wake{int(ahead_s * 1e6)}", world_size=2, timeout_s=30, options={})
    spec = TransportSpec(transport="shm", session_id=sender.session_id, world_size=2, timeout_s=30,
                         options=sender.spec_options())
    receiver = ShmReceiver(spec, rank=1)
    receiver.connect()
    sender.connect()
    state = {f"w{i}": torch.randn(256) for i in range(4)}
    spans: list[float] = []
    try:
        for _ in range(pushes):
            manifest = plan_manifest(specs_of(list(state.items())), version=1, bucket_bytes=1 << 20,
                                     transport="shm", timeout_s=30)
            got: list[float] = []
            thread = threading.Thread(target=_receive, args=(receiver, manifest, got))
            thread.start()
            time.sleep(ahead_s)
            sender.begin(manifest)
            buf = sender.bucket_buffer(0, manifest.buckets[0].nbytes)
            assert buf is not None
            pack_bucket(manifest, 0, dict(state), buf)
            sender.send_bucket(BucketHeader(index=0, nbytes=manifest.buckets[0].nbytes, checksum=0), buf)
            published = time.perf_counter()
            sender.end(manifest)
            thread.join(30)
            spans.append(got[0] - published)
    finally:
        receiver.close()
        sender.close()
    spans.sort()
    return {"median_us": round(statistics.median(spans) * 1e6, 1), "p90_us": round(spans[int(0.9 * len(spans))] * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ahead-s", default="0.01,0.3")
    parser.add_argument("--pushes", type=int, default=30)
    args = parser.parse_args()
    out = {f"ahead_{a}s": measure(float(a), args.pushes) for a in args.ahead_s.split(",")}
    print(json.dumps({"pushes": args.pushes, **out}))


if __name__ == "__main__":
    main()
