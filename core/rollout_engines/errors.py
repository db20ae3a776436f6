"""Errors a caller can catch. Each message says what to do next."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class RolloutEnginesError(Exception):
    """Base class of every error this library raises on purpose."""


class UnknownBackend(RolloutEnginesError, KeyError):
    def __init__(self, name: str, known: Iterable[str], installed: Iterable[str] = ()) -> None:
        known = sorted(set(known))
        installed = sorted(set(installed))
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        msg = (
            f"unknown backend '{name}'.{hint} Installed: {', '.join(installed) or 'none'}; "
            f"known: {', '.join(known)}. Run `rollout-engines backends` to list them."
        )
        self.name, self.suggestion, self.message = name, (close[0] if close else None), msg
        super().__init__(msg)

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class UnknownTransport(RolloutEnginesError, KeyError):
    def __init__(self, name: str, known: Iterable[str]) -> None:
        known = sorted(known)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        self.message = f"unknown weight transport '{name}'.{hint} Known: {', '.join(known)}."
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class BackendNotInstalled(RolloutEnginesError, ImportError):
    def __init__(self, name: str, install_hint: str, cause: str | None = None) -> None:
        msg = f"backend '{name}' is not installed. Install it with: {install_hint}"
        if cause:
            msg += f" (import failed: {cause})"
        self.name, self.install_hint = name, install_hint
        super().__init__(msg)


class BackendLoadError(RolloutEnginesError):
    """A plugin is installed but failed to load for another reason than a missing library."""


class DuplicateBackend(RolloutEnginesError):
    def __init__(self, kind: str, name: str, first: str, second: str) -> None:
        first, second = sorted((first, second))  # discovery order depends on sys.path; the message does not
        super().__init__(
            f"{kind} '{name}' is registered by two distributions: '{first}' and '{second}'. "
            f"Uninstall one, or block one with ROLLOUT_ENGINES_PLUGINS_DENY."
        )
        self.name, self.distributions = name, (first, second)


class CapabilityError(RolloutEnginesError, NotImplementedError):
    """The backend does not declare the capability this call needs."""


class InvalidRequest(RolloutEnginesError, ValueError):
    """A request that passed field validation but does not fit this engine's model (a token id
    outside the vocabulary, a prompt longer than the context window, an empty prompt)."""


class EngineClosed(RolloutEnginesError):
    """The engine was closed; create a new one."""


class EngineAsleep(RolloutEnginesError):
    """Generation was asked of an engine whose weights or KV cache are released; call wake_up()."""


class EngineUnavailable(RolloutEnginesError):
    """An engine (or every engine of a group) cannot serve right now; retry later or add engines."""


class WeightSyncError(RolloutEnginesError):
    """A weight update was rejected, interrupted or timed out. The engine keeps its previous
    weights (or, where stated, refuses to generate until the next complete push)."""

    def __init__(self, message: str, *, peer: str | None = None, bucket: int | None = None) -> None:
        parts = [message]
        if peer is not None:
            parts.append(f"peer: {peer}")
        if bucket is not None:
            parts.append(f"bucket: {bucket}")
        super().__init__("; ".join(parts))
        self.peer, self.bucket = peer, bucket


class ManifestMismatch(WeightSyncError):
    """The manifest does not fit the model (unknown names, wrong shapes or dtypes). Nothing was applied."""


class StaleVersion(ManifestMismatch):
    """The update's version is not above the engine's current one (pass ``allow_rollback=True``
    to go back on purpose). Nothing was applied."""


class UpdateRefused(ManifestMismatch):
    """The engine refused the update from its description alone, before reading any of it (a LoRA
    rank above what it serves, no free adapter slot). Nothing was applied."""


class WeightsInvalidated(WeightSyncError):
    """The engine's weights are incomplete (an in-place update failed midway, or weights were
    released by sleep and not restored). It refuses to generate until a complete push arrives."""
