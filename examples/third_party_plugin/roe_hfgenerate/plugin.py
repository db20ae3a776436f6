"""Registration only: cheap, imports no torch (the engine module is imported on first use)."""

from collections.abc import Callable

from rollout_engines import BackendEntry, hookimpl


@hookimpl
def register_backends(register: Callable[[BackendEntry], None]) -> None:
    register(
        BackendEntry(
            name="hfgenerate",
            target="roe_hfgenerate.engine:HFGenerateEngine",
            install_hint='pip install "rollout-engines-hfgenerate"',
            requires=("transformers", "torch"),
            description="Example plugin: transformers generate(), one prompt at a time.",
            capabilities={"sleep_levels": [], "transports": ["inproc", "shm", "gloo", "disk"]},
        )
    )
