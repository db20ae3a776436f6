"""A plugin that claims the backend name 'good' a second time, used by the registry tests."""
from rollout_engines import BackendEntry, hookimpl


@hookimpl
def register_backends(register):
    register(BackendEntry(name="good", target="roe_dupplug:Nothing", install_hint='pip install "roe-dupplug"'))
