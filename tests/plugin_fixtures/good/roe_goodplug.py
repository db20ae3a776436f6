"""A well-behaved third-party plugin used by the registry tests (loaded from a fake dist-info)."""
from rollout_engines import BackendEntry, hookimpl


@hookimpl
def register_backends(register):
    spec = BackendEntry(name="good", target="rollout_engines.backends.transformers.engine:TransformersEngine",
                       install_hint='pip install "roe-goodplug"')
    register(spec)
    register(spec)  # registering the same spec twice is a no-op (plugins load again in workers)
    register(BackendEntry(name="needslib", target="definitely_not_installed_lib.engine:Engine",
                         install_hint='pip install "roe-goodplug[needslib]"',
                         requires=("definitely_not_installed_lib",)))
