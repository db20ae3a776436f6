"""Run one benchmark command and append its result to ``benchmarks/results.jsonl``.

    python benchmarks/record.py --name "bench push vllm ~1B" [--out FILE] [--commit SHA] -- \
        python -m rollout_engines bench push --backend vllm --model $MEDIUM --json

The command must print its result as a JSON line (``--json``); engines may log on stdout too, so
the last line that parses as a JSON object is taken. One line is appended: ``name``, ``date``
(UTC), ``commit`` (``--commit``, else ``git rev-parse --short HEAD``, else ``ROE_COMMIT``),
``machine`` (GPU name, torch, and vLLM / SGLang versions where importable), ``command`` (as run; each
``--alias NAME=PATH`` writes PATH as ``$NAME``, here and in the result), ``wall_s`` and ``result``. The command's stdout and
stderr are also kept next to ``--out`` as ``<name>.log`` when ``--logs DIR`` is given. Exit status:
the command's, or 3 when it printed no JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path


def machine() -> str:
    parts = []
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            parts.append(f"{n}x {torch.cuda.get_device_name(0)}")
        else:
            parts.append(f"CPU ({os.cpu_count()} cores)")
        parts.append(f"torch {torch.__version__}")
    except ImportError:
        parts.append(f"CPU ({os.cpu_count()} cores)")
    for dist in ("vllm", "sglang"):
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(parts)


def commit(given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("ROE_COMMIT", "unknown")


def last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results.jsonl")))
    parser.add_argument("--commit", default=None)
    parser.add_argument("--logs", default=None, help="directory to keep the command's output in")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the command is killed")
    parser.add_argument("--alias", action="append", default=[], metavar="NAME=PATH",
                        help="write PATH as $NAME in the recorded command and result (model directories)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the benchmark command after --")
    start = time.perf_counter()
    # Its own process group: on a timeout the engine processes it started (vLLM's engine core,
    # SGLang's scheduler) go too, instead of keeping their GPU memory from the next command.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=args.timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        rc, err = 124, err + "\ntimed out"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind
        except ProcessLookupError:
            pass
    wall = time.perf_counter() - start
    if args.logs:
        logs = Path(args.logs)
        logs.mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", args.name).strip("_")
        (logs / f"{slug}.log").write_text(f"$ {shlex.join(command)}\nrc={rc}\n--- stdout\n{out}\n--- stderr\n{err}")
    result = last_json(out)
    if result is None:
        print(f"{args.name}: rc={rc}, no JSON result; stderr tail:\n{err[-2000:]}", file=sys.stderr)
        return rc or 3
    row = {
        "name": args.name,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": commit(args.commit),
        "machine": machine(),
        "command": shlex.join(command),
        "wall_s": round(wall, 1),
        "result": result,
    }
    line = json.dumps(row)
    for alias in args.alias:
        name, _, path = alias.partition("=")
        if path:
            line = line.replace(path, "$" + name)
    with open(args.out, "a") as f:
        f.write(line + "\n")
    print(line)
    return rc


if __name__ == "__main__":
    sys.exit(main())
