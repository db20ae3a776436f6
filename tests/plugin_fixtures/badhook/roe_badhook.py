"""A plugin with a hook implementation that matches no spec (a typo), used by the registry tests."""
from rollout_engines import hookimpl


@hookimpl
def register_backend(register):  # missing 's': pluggy's check_pending rejects it
    raise AssertionError("never called")
