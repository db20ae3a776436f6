"""The ``rollout-engines`` command.

    rollout-engines backends [--json]
    rollout-engines demo [--backend transformers] [--model PATH] [--engines N] [--ray] [--json]
    rollout-engines check --backend NAME [--model PATH] [--option KEY=VALUE ...]
    rollout-engines bench weight-sync|generate|group|push|async|refit ... --json
    rollout-engines serve --backend NAME --model PATH [--host H] [--port P] [--api-key K]

Heavy libraries (torch, vllm, ray, fastapi) are imported only by the subcommand that needs them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from .errors import RolloutEnginesError
from .options import add_option_argument

BENCHES = {
    "weight-sync": "rollout_engines.bench.weight_sync",
    "generate": "rollout_engines.bench.generate",
    "group": "rollout_engines.bench.group",
    "push": "rollout_engines.bench.push",
    "async": "rollout_engines.bench.async_",
    "refit": "rollout_engines.bench.refit",
}


def _console(json_mode: bool) -> Any:
    from rich.console import Console

    # In --json mode the human-readable lines go to stderr so stdout is parseable.
    return Console(stderr=json_mode, highlight=False)


def cmd_backends(args: argparse.Namespace) -> int:
    from .plugins import get_registry

    registry = get_registry()
    rows = [r.as_dict() for r in registry.records()]
    if args.json:
        print(json.dumps(rows))
        return 0
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="rollout-engines backends")
    for col in ("name", "installed", "distribution", "version", "install / error"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["name"], "yes" if r["installed"] else "no", r["distribution"] or "-", r["version"] or "-",
            escape(r["error"] or ("" if r["installed"] else r["install_hint"])),
        )
    console = _console(False)
    console.print(table)
    if registry.transports:
        console.print("transports: " + ", ".join(sorted(registry.transports)))
    for failure in registry.failures:
        console.print(escape(f"plugin '{failure.entry_point}' ({failure.distribution}) failed: {failure.error}"), style="yellow")
    return 0


def _at_least_one(option: str) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= 1, else a usage error naming ``option``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} wants an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{option} must be >= 1, got {value}")
        return value

    return parse


def cmd_demo(args: argparse.Namespace) -> int:
    console = _console(args.json)
    say = console.print
    if args.engines > 1 or args.ray:
        if args.transport is not None:  # the group demo picks its own (inproc, gloo with Ray)
            args.parser.error("--transport applies to one engine; leave it out with --engines N > 1 or --ray")
        from .demo_group import run_group_demo

        summary = run_group_demo(
            args.backend, args.model, engines=args.engines, use_ray=args.ray, say=say, max_tokens=args.max_tokens,
        )
    else:
        from .demo import main_demo

        summary = main_demo(args.backend, args.model, args.transport, args.max_tokens, say)
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            say(f"  {key}: {value}")
    ok = summary.get("outputs_changed") and summary.get("same_after_wake", True)
    return 0 if ok else 1


def cmd_check(args: argparse.Namespace) -> int:
    from .options import merge_options
    from .testing.conformance import run_conformance

    return run_conformance(args.backend, args.model, list(args.pytest_args or []),
                           options=merge_options(args.option) or None)


def cmd_bench(args: argparse.Namespace) -> int:
    result = args.bench_module.run(args)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


def cmd_serve(argv: list[str]) -> int:
    try:
        server = importlib.import_module("rollout_engines_remote.server")
    except ImportError as exc:
        from .errors import BackendNotInstalled
        from .plugins import first_party_hint

        raise BackendNotInstalled("remote", first_party_hint("remote"), cause=str(exc)) from exc
    return int(server.main(argv) or 0)


def build_parser(bench_module: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; ``bench_module`` (a key of BENCHES) adds that benchmark's own options."""
    parser = argparse.ArgumentParser(prog="rollout-engines", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list known backends, installed or not")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("demo", help="generate, push new weights, sleep/wake: the main job end to end")
    p.add_argument("--backend", default="transformers")
    p.add_argument("--model", default=None, help="model directory (default: the tiny test model)")
    p.add_argument("--transport", default=None, help="weight transport of the one-engine demo (default: the cheapest the engine declares)")
    p.add_argument("--max-tokens", type=_at_least_one("--max-tokens"), default=32)
    p.add_argument("--engines", type=_at_least_one("--engines"), default=1, help="run on an EngineGroup of N engines")
    p.add_argument("--ray", action="store_true", help="engines as Ray actors")
    p.add_argument("--json", action="store_true", help="print one JSON summary last")
    p.set_defaults(func=cmd_demo, parser=p)

    p = sub.add_parser("check", help="run the conformance suite against a backend")
    p.add_argument("--backend", required=True)
    p.add_argument("--model", default=None)
    add_option_argument(p, "engine option for every engine the suite creates (e.g. enable_lora=true)")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("bench", help="benchmarks (JSON with --json)")
    bench = p.add_subparsers(dest="bench", required=True)
    for name, module in BENCHES.items():
        bp = bench.add_parser(name)
        bp.add_argument("--json", action="store_true")
        bp.set_defaults(func=cmd_bench, bench_module_name=module)
        if name == bench_module:
            importlib.import_module(module).add_arguments(bp)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO if "-v" in argv or "--verbose" in argv else logging.WARNING)
    try:
        if argv[:1] == ["serve"]:  # the server owns its own arguments
            return cmd_serve(argv[1:])
        # Bench modules add their own arguments; import only the one asked for.
        wanted = argv[1] if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHES else None
        args = build_parser(wanted).parse_args(argv)
        if getattr(args, "bench_module_name", None):
            args.bench_module = importlib.import_module(args.bench_module_name)
        return int(args.func(args) or 0)
    except RolloutEnginesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
