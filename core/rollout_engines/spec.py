"""What plugins declare, in one place: a backend's registration (:class:`BackendEntry`), a weight
transport's (:class:`TransportEntry`) and what an engine can do (:class:`Capabilities`).

The other "spec" types describe data, not plugins: :class:`~rollout_engines.weights.manifest.TransportSpec`
is one weight-sync session's connection details, :class:`~rollout_engines.weights.manifest.TensorSpec`
one tensor's name, dtype and shape. ``BackendSpec`` is the former name of :class:`BackendEntry`.

Nothing here imports an engine library or the engine module: listings read these cheaply.
"""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .types import PauseMode


class Capabilities(BaseModel):
    """What a backend can do, declared up front (never discovered by trial). Every default is the
    conservative one (off, empty, zero) but ``generate``: a backend declares what it has, so a
    minimal backend never claims what it cannot do."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    generate: bool = True
    chat: bool = False
    logprobs: bool = False
    n: bool = False
    stop_strings: bool = False
    seed: bool = False
    sleep_levels: tuple[int, ...] = Field(default=(), description="Empty: sleep is not supported.")
    sleep_tags: tuple[str, ...] = ()
    weights_kept_on_sleep: bool = Field(
        default=False,
        description="False: waking the 'weights' tag restores memory, not values; a push must follow "
        "before generation (SGLang releases weights; vLLM sleep level 2 discards them).",
    )
    pause: bool = False
    pause_modes: tuple[PauseMode, ...] = Field(
        default=(), description="Modes of pause() beyond the plain 'wait' that 'pause' grants."
    )
    streaming: bool = Field(default=False, description="stream() yields tokens as they are made.")
    abort: bool = Field(default=False, description="abort(request_ids) ends running requests early.")
    top_logprobs: int = Field(default=0, ge=0, description="Largest SamplingParams.top_logprobs served.")
    prompt_logprobs: bool = False
    continuation: bool = Field(default=False, description="GenerateRequest.continue_from is served.")
    lora: int = Field(default=0, ge=0, description="Largest LoRA rank served; 0: no LoRA adapters.")
    max_loras: int = Field(default=0, ge=0, description="Adapters loaded at once (0: no LoRA).")
    prefix_cache: bool = False
    transports: tuple[str, ...] = ()
    tensor_parallel: bool = False
    multi_process: bool = Field(default=False, description="Workers run outside the caller's process.")

    def supports_sleep(self) -> bool:
        return bool(self.sleep_levels)


class BackendEntry(BaseModel):
    """A backend as registered: cheap metadata plus the dotted path of its engine class."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z][a-z0-9_\-]*$")
    target: str = Field(description="'package.module:EngineClass', imported on first use.")
    install_hint: str
    requires: tuple[str, ...] = Field(default=(), description="Modules that must be importable.")
    capabilities: dict[str, Any] = Field(default_factory=dict, description="Declared, for listings.")
    description: str = ""
    generate_baseline: str | None = Field(
        default=None,
        description="'package.module:function' that runs `rollout-engines bench generate` against the "
        "backend's own API (function(GenerateArgs) -> dict, see rollout_engines.bench.generate); imported "
        "only by the benchmark. None: the benchmark reports this library's side alone.",
    )
    ray_bundle_env: str | None = Field(
        default=None,
        description="'package.module:function' of a RayBundle returning the environment variables the "
        "engine library reads to place workers it starts through Ray (vLLM: VLLM_RAY_BUNDLE_INDICES, "
        "VLLM_RAY_PER_WORKER_GPUS); used by rollout_engines.envs.setup_device_env. Must import no engine library.",
    )
    main_thread_setup: str | None = Field(
        default=None,
        description="'package.module:function' of no arguments, to call on the main thread of a process "
        "that will create engines of this backend from other threads (SGLang: its SIGQUIT guard, a signal "
        "handler only the main thread can install). The pytest plugin calls it for tests marked with the "
        "backend; None: nothing to do. Must import no engine library.",
    )

    def load_generate_baseline(self) -> Any:
        """The :attr:`generate_baseline` function, or None where the backend has none."""
        return None if self.generate_baseline is None else import_target(self.generate_baseline)

    def load_ray_bundle_env(self) -> Any:
        """The :attr:`ray_bundle_env` function, or None where the backend has none."""
        return None if self.ray_bundle_env is None else import_target(self.ray_bundle_env)

    def load_main_thread_setup(self) -> Any:
        """The :attr:`main_thread_setup` function, or None where the backend has none."""
        return None if self.main_thread_setup is None else import_target(self.main_thread_setup)


class TransportEntry(BaseModel):
    """A weight transport as registered: the dotted paths of its two halves."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z][a-z0-9_\-]*$")
    sender: str = Field(description="'package.module:SenderClass'")
    receiver: str = Field(description="'package.module:ReceiverClass'")
    devices: tuple[str, ...] = ("cpu",)
    description: str = ""

    def load_sender(self) -> Any:
        return import_target(self.sender)

    def load_receiver(self) -> Any:
        return import_target(self.receiver)


#: The former name of :class:`BackendEntry`.
BackendSpec = BackendEntry


def import_target(target: str) -> Any:
    """The object named by ``'package.module:attr.path'`` (imported now)."""
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj
