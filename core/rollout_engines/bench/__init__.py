"""Benchmarks behind `rollout-engines bench ...`: each module has ``add_arguments(parser)`` and
``run(args) -> dict``; the CLI prints the dict as the last line of output, as JSON.

Benchmarks are clients of the engines: they read what engines measured through
:meth:`~rollout_engines.engine.EngineProtocol.diagnostics`, and a backend's direct baseline for
``bench generate`` is named by its :class:`~rollout_engines.plugins.BackendEntry`
(``generate_baseline``; the core's own are in :mod:`.baselines`). No engine module imports this
package (``tests/test_import_rules.py``).
"""
