"""Entry point of ``rollout-engines-remote``: the ``remote`` backend and the ``http`` transport.

Registration is metadata only: neither FastAPI nor httpx is imported here.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout_engines import BackendEntry, TransportEntry, hookimpl
from rollout_engines.plugins import first_party_hint


@hookimpl
def register_backends(register: Callable[[BackendEntry], None]) -> None:
    register(
        BackendEntry(
            name="remote",
            target="rollout_engines_remote.client:RemoteEngine",
            install_hint=first_party_hint("remote"),
            requires=("httpx",),
            description="A rollout-engines server, a plain vLLM server or a plain SGLang server over HTTP.",
            capabilities={"transports": ["http"], "multi_process": True},
            generate_baseline="rollout_engines_remote.bench:generate_baseline",
        )
    )


@hookimpl
def register_transports(register: Callable[[TransportEntry], None]) -> None:
    register(
        TransportEntry(
            name="http",
            sender="rollout_engines_remote.transport:HttpSender",
            receiver="rollout_engines_remote.transport:HttpReceiver",
            devices=("cpu", "cuda"),
            description="safetensors-framed buckets POSTed to rollout-engines servers",
        )
    )
