"""A third-party plugin whose entry point is named 'core', like the core's own: the allow list's
exemption for the core must not let it in."""
from rollout_engines import BackendEntry, hookimpl


@hookimpl
def register_backends(register):
    register(BackendEntry(name="fakecore", target="roe_fakecore:Nothing", install_hint='pip install "roe-fakecore"'))
