"""Engine settings from keyword arguments and from ``--option KEY=VALUE`` (rollout_engines.options),
one parser for every command (``bench``, ``serve``)."""

from __future__ import annotations

import argparse

import pytest
from rollout_engines.options import add_option_argument, merge_options, parse_option, split_engine_kwargs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prog")
    add_option_argument(parser)
    return parser


def test_values_are_json_where_they_parse_else_strings() -> None:
    ns = _parser().parse_args([
        "--option", "n=4", "--option", "eager=true", "--option", 'dtype="float32"', "--option", "dtype2=float32",
        "--option", "ids=[1, 2]", "--option", "empty=", "--option", "url=http://h:1/a=b", "--option", "nothing=null",
    ])
    assert merge_options(ns.option) == {
        "n": 4, "eager": True, "dtype": "float32", "dtype2": "float32", "ids": [1, 2], "empty": "",
        "url": "http://h:1/a=b", "nothing": None,
    }


def test_the_last_of_a_repeated_key_wins() -> None:
    ns = _parser().parse_args(["--option", "k=1", "--option", "k=2"])
    assert merge_options(ns.option) == {"k": 2}
    assert merge_options(["k=3"], base={"k": 1, "j": 0}) == {"k": 3, "j": 0}  # dicts of strings too


@pytest.mark.parametrize("bad", ["no_equals", "=value", " =1"])
def test_a_malformed_option_is_a_usage_error_that_says_what_to_write(bad, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["--option", bad])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--option wants KEY=VALUE" in err and repr(bad) in err
    with pytest.raises(ValueError, match="KEY=VALUE"):  # outside argparse: a ValueError
        parse_option(bad)


def test_split_engine_kwargs_sends_unknown_names_to_options() -> None:
    fields, options = split_engine_kwargs({"dtype": "float32", "seed": 3, "enforce_eager": True,
                                           "options": {"a": 1, "enforce_eager": False}})
    assert fields == {"dtype": "float32", "seed": 3}
    assert options == {"a": 1, "enforce_eager": True}  # a keyword argument wins over options[...]
    assert split_engine_kwargs({}) == ({}, {})


def test_create_engine_with_a_config_refuses_settings_it_would_drop() -> None:
    """``create_engine(config, ...)``: the config holds every setting, so a model or an option given
    beside it is refused (it used to be dropped without a word) with what to write instead."""
    from rollout_engines import EngineConfig, create_engine

    config = EngineConfig(backend="no-such-backend", model="m")
    with pytest.raises(TypeError, match=r"got model, enforce_eager beside it; .*options"):
        create_engine(config, model="other", enforce_eager=True)
    with pytest.raises(TypeError, match="got seed beside it"):
        create_engine(config, seed=3)
