"""A plugin of another distribution under the entry-point name 'goodplug' that roe_goodplug uses,
claiming the backend name 'good' too (two packages picking the obvious entry-point name)."""
from rollout_engines import BackendEntry, hookimpl


@hookimpl
def register_backends(register):
    register(BackendEntry(name="good", target="roe_samename:Nothing", install_hint='pip install "roe-samename"'))
    register(BackendEntry(name="samename", target="roe_samename:Nothing", install_hint='pip install "roe-samename"'))
