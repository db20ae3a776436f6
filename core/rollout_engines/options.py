"""Engine settings from keyword arguments and from the command line, one way everywhere.

- :func:`split_engine_kwargs`: keyword arguments of ``create_engine`` (and of every other host
  that builds an :class:`~.types.EngineConfig`) split into config fields and backend options.
- ``--option KEY=VALUE`` (:func:`add_option_argument`, :func:`parse_option`,
  :func:`merge_options`): VALUE is parsed as JSON where it parses (``4``, ``true``, ``"x"``,
  ``[1, 2]``) and kept as a string otherwise; a repeated KEY keeps its last value; a missing ``=``
  (or an empty KEY) is a usage error that says what to write.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping
from typing import Any

from .types import EngineConfig

OPTION_METAVAR = "KEY=VALUE"


def split_engine_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(EngineConfig fields, backend options)`` of ``kwargs``; an ``options`` mapping among them
    is merged into the options (a keyword argument of the same name wins)."""
    fields = set(EngineConfig.model_fields)
    config = {k: v for k, v in kwargs.items() if k in fields and k != "options"}
    options = dict(kwargs.get("options") or {})
    options.update({k: v for k, v in kwargs.items() if k not in fields})
    return config, options


def engine_config(backend: str | EngineConfig, model: str | None, kwargs: Mapping[str, Any], *,
                  caller: str = "create_engine") -> EngineConfig:
    """The :class:`EngineConfig` of ``caller(backend, model=..., **kwargs)``: a config as it is
    (``model`` or settings beside it are a ``TypeError``: they would be dropped), or one built from
    the backend's name, ``model`` and the settings (:func:`split_engine_kwargs`)."""
    if isinstance(backend, EngineConfig):
        extra = (["model"] if model is not None else []) + list(kwargs)
        if extra:
            raise TypeError(
                f"{caller}(config) takes every setting from the EngineConfig; got {', '.join(extra)} "
                "beside it; put them in the config (config.model_copy(update={...}), backend settings "
                f"under options), or call {caller}(backend_name, model=..., **settings)"
            )
        return backend
    if model is None:
        raise ValueError(
            f"{caller} needs model=PATH (for a tiny local test model: "
            "rollout_engines.testing.tiny_model.tiny_model_path())"
        )
    fields, options = split_engine_kwargs(kwargs)
    return EngineConfig(backend=backend, model=str(model), options=options, **fields)


class InvalidOption(argparse.ArgumentTypeError, ValueError):
    """An ``--option`` that is not ``KEY=VALUE`` (argparse shows the message as a usage error)."""


def parse_option(text: str) -> tuple[str, Any]:
    """``"KEY=VALUE"`` -> ``(KEY, VALUE as JSON, else the string)``; the argparse ``type`` of ``--option``."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise InvalidOption(f"--option wants {OPTION_METAVAR} (e.g. --option enforce_eager=true), got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def merge_options(items: Iterable[tuple[str, Any] | str], base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``base`` updated with ``items`` in order (the last value of a repeated key wins). Items are
    ``(KEY, value)`` pairs (what :func:`parse_option` made) or ``"KEY=VALUE"`` strings."""
    out = dict(base or {})
    for item in items:
        key, value = parse_option(item) if isinstance(item, str) else item
        out[key] = value
    return out


def add_option_argument(parser: argparse.ArgumentParser, help: str = "engine option") -> None:
    """Add the repeatable ``--option KEY=VALUE`` argument (``args.option``: a list of pairs)."""
    parser.add_argument(
        "--option", action="append", type=parse_option, default=[], metavar=OPTION_METAVAR,
        help=f"{help} (repeatable; VALUE parsed as JSON where it parses, else a string; the last of a repeated KEY wins)",
    )
