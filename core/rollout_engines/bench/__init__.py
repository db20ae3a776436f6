"""Benchmarks behind `rollout-engines bench ...`: each module has ``add_arguments(parser)`` and
``run(args) -> dict``; the CLI prints the dict as the last line of output, as JSON."""
