"""Run the weight-sync benchmark for every CPU transport and print one JSON line each.

    python benchmarks/weight_sync.py                 # shm, gloo (2 receivers), disk, inproc; 1 GiB, 320 tensors
    python benchmarks/weight_sync.py --size-mb 256   # smaller, faster

Each line is the output of ``rollout-engines bench weight-sync --transport T ... --json``.
"""

from __future__ import annotations

import argparse
import json

from rollout_engines.bench import weight_sync

RUNS = {
    "shm": ["--receivers", "1"],
    "gloo": ["--receivers", "2"],
    "disk": ["--receivers", "1"],
    "inproc": [],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", default="1024")
    parser.add_argument("--tensors", default="320")
    parser.add_argument("--bucket-mb", default="64")
    parser.add_argument("--transports", default=",".join(RUNS))
    args = parser.parse_args()
    for transport in args.transports.split(","):
        bench = argparse.ArgumentParser()
        weight_sync.add_arguments(bench)
        argv = ["--transport", transport, "--size-mb", args.size_mb, "--tensors", args.tensors,
                "--bucket-mb", args.bucket_mb, *RUNS.get(transport, [])]
        print(json.dumps(weight_sync.run(bench.parse_args(argv))), flush=True)


if __name__ == "__main__":
    main()
