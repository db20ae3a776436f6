"""LoRA adapters as weight updates: what a LoRA push must carry, checked against the base model.

A trainer pushes an adapter with :meth:`~rollout_engines.weights.session.WeightSync.push_lora`:
the same sessions, transports, buckets and checksums as a full push, with ``manifest.lora`` set.
Its tensors are named as PEFT saves them (``base_model.model.<module>.lora_A.weight``, shape
``[rank, in_features]``; ``...lora_B.weight``, ``[out_features, rank]``), one pair for every module
of the base model whose name ends in one of ``target_modules``. Backends check an incoming adapter
with :func:`lora_expected_specs` (built from the base model's expected specs, HF names), so an
adapter that names a module the model lacks, or whose shapes do not fit, is refused before anything
is received.

On the engine's side, :func:`receive_lora` takes one LoRA push through a worker's existing
:class:`~rollout_engines.weights.receiver.WeightReceiver` (any transport) and returns the adapter's
tensors; the backend installs them (one dict entry swapped between two steps, say). The receiver's
base version and delta record are untouched, so delta pushes of the base keep working.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import ManifestMismatch
from ..types import LoraSpec
from .manifest import ExpectedSpec, TensorSpec, WeightManifest, validate_manifest

if TYPE_CHECKING:
    from .receiver import WeightReceiver

PEFT_PREFIX = "base_model.model."
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def target_weights(base: Mapping[str, TensorSpec], spec: LoraSpec) -> dict[str, TensorSpec]:
    """Module name -> spec of its 2-D ``.weight``, for every module ``spec`` targets.

    Raises :class:`ManifestMismatch` when a target module matches nothing in the model."""
    found: dict[str, TensorSpec] = {}
    for name, t in base.items():
        if not name.endswith(".weight") or len(t.shape) != 2:
            continue
        module = name[: -len(".weight")]
        if module.rsplit(".", 1)[-1] in spec.target_modules:
            found[module] = t
    missing = [m for m in spec.target_modules if not any(k.rsplit(".", 1)[-1] == m for k in found)]
    if missing:
        raise ManifestMismatch(
            f"LoRA adapter '{spec.name}' targets modules the base model lacks: {missing}; "
            "target_modules name the last component of linear layers (e.g. 'q_proj', 'v_proj')"
        )
    return found


def lora_expected_specs(base: Mapping[str, TensorSpec], spec: LoraSpec, dtype: str | torch.dtype) -> dict[str, ExpectedSpec]:
    """Name -> spec of every tensor a push of adapter ``spec`` must carry, in ``dtype`` (one of
    float32, bfloat16, float16: the adapter's own, which may differ from the model's)."""
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in _FLOAT_DTYPES:
        raise ManifestMismatch(f"LoRA adapter '{spec.name}' tensors must be one of {_FLOAT_DTYPES}, not {dtype_name}")
    out: dict[str, ExpectedSpec] = {}
    for module, weight in target_weights(base, spec).items():
        rows, cols = weight.shape
        out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = ExpectedSpec(name=f"{PEFT_PREFIX}{module}.lora_A.weight",
                                                                  dtype=dtype_name, shape=(spec.rank, cols))
        out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = ExpectedSpec(name=f"{PEFT_PREFIX}{module}.lora_B.weight",
                                                                  dtype=dtype_name, shape=(rows, spec.rank))
    return out


def module_of(name: str) -> tuple[str, str]:
    """``base_model.model.X.lora_A.weight`` -> (``X``, ``"A"``)."""
    if not name.startswith(PEFT_PREFIX) or not name.endswith(".weight"):
        raise ManifestMismatch(f"'{name}' is not a PEFT LoRA tensor name (base_model.model.<module>.lora_A.weight)")
    stem = name[len(PEFT_PREFIX): -len(".weight")]
    module, _, which = stem.rpartition(".")
    if which not in ("lora_A", "lora_B"):
        raise ManifestMismatch(f"'{name}' is neither a lora_A nor a lora_B tensor")
    return module, which[-1]


class LoraTarget:
    """A :class:`~rollout_engines.weights.receiver.WeightTarget` that keeps an adapter's tensors in
    :attr:`tensors` (owned copies), for :meth:`WeightReceiver.receive_side`; the model is not touched."""

    def __init__(self, expected: Mapping[str, ExpectedSpec]) -> None:
        self._expected = expected
        self.tensors: dict[str, torch.Tensor] = {}

    def expected_specs(self) -> Mapping[str, ExpectedSpec]:
        return self._expected

    def apply(self, named: Sequence[tuple[str, torch.Tensor]], *, owned: bool) -> None:
        for name, tensor in named:
            self.tensors[name] = tensor if owned else tensor.clone()


def lora_problem(manifest: WeightManifest, base: Mapping[str, TensorSpec]) -> tuple[dict[str, ExpectedSpec], ManifestMismatch | None]:
    """What a LoRA push must carry, and why ``manifest`` does not (None: it fits the base model).

    Strict: every ``lora_A``/``lora_B`` tensor of every targeted module, nothing else, exact shapes
    (``[rank, in]``, ``[out, rank]``), one float dtype for all."""
    spec = manifest.lora
    if spec is None:
        raise ValueError("not a LoRA push: manifest.lora is None")
    try:
        if manifest.delta is not None or manifest.partial:
            raise ManifestMismatch("a LoRA push is always whole (no delta, not partial)")
        dtypes = sorted({t.dtype for t in manifest.tensors})
        if len(dtypes) > 1:
            raise ManifestMismatch(f"its tensors mix dtypes {dtypes}; send every lora_A/lora_B tensor in one dtype")
        expected = lora_expected_specs(base, spec, dtypes[0] if dtypes else "float32")
        validate_manifest(manifest, expected, partial_ok=False)
    except ManifestMismatch as exc:
        return {}, ManifestMismatch(
            f"LoRA adapter '{spec.name}' v{manifest.version} (rank {spec.rank}, targets {spec.target_modules}) "
            f"refused, nothing installed: {exc}"
        )
    return expected, None


def receive_lora(receiver: WeightReceiver, manifest: WeightManifest, base: Mapping[str, TensorSpec], *,
                 supported: Collection[str] | None = None, hint: str = "") -> dict[str, torch.Tensor]:
    """Receive the LoRA push ``manifest`` through ``receiver``'s session; returns its tensors by
    PEFT name (owned; on the receiver's device, in the adapter's dtype).

    ``base``: name -> spec of the base model's weights (HF names). ``supported``: the module names
    (last components, ``q_proj``) the backend can adapt, where it cannot adapt every linear layer
    of ``base``; an adapter targeting another layer the model has is refused, the message ending
    in ``hint`` (what to do). The push is checked before anything is received (:func:`lora_problem`);
    a refused one raises :class:`ManifestMismatch` after the stream was drained, so the session
    stays in step. The receiver's base version and delta record do not change. Call it where
    ``receiver.receive`` is called for full pushes (a worker thread); each worker of a
    tensor-parallel engine gets the whole adapter."""
    if supported is not None:
        spec = manifest.lora
        assert spec is not None
        wanted = set(supported)
        present = {_leaf(n) for n in base}
        outside = sorted((set(spec.target_modules) & present) - wanted)
        if outside:
            problem = ManifestMismatch(
                f"LoRA adapter '{spec.name}' targets {outside}, which this engine cannot serve LoRA on "
                f"(it adapts {sorted(wanted)})" + (f"; {hint}" if hint else "")
            )
            receiver.receive_side(manifest, LoraTarget({}), rejection=problem)
            raise problem  # receive_side raises it already, once the stream is drained
        base = {n: s for n, s in base.items() if _leaf(n) in wanted}
    expected, rejection = lora_problem(manifest, base)
    target = LoraTarget(expected)
    receiver.receive_side(manifest, target, rejection=rejection)
    return target.tensors


def _leaf(name: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``q_proj``."""
    return name.removesuffix(".weight").rsplit(".", 1)[-1]


def split_adapter(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT-named tensors -> module name -> ``(A, B)`` (``A``: ``[rank, in]``, ``B``: ``[out, rank]``)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module, which = module_of(name)
        halves.setdefault(module, {})[which] = tensor
    missing = [m for m, h in halves.items() if set(h) != {"A", "B"}]
    if missing:
        raise ManifestMismatch(f"modules {missing} lack a lora_A or a lora_B tensor")
    return {m: (h["A"], h["B"]) for m, h in halves.items()}


class _PeftLoraConfig(BaseModel):
    """The values of PEFT's ``adapter_config.json`` a LoRA push is built from (the other keys
    are only checked for features a push cannot carry)."""

    model_config = ConfigDict(extra="ignore")

    r: int
    lora_alpha: float | None = None
    use_rslora: bool | None = None


def load_peft_adapter(path: str | Path, name: str) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """A LoRA adapter saved by PEFT (``save_pretrained``: ``adapter_config.json`` and
    ``adapter_model.safetensors``), as ``push_lora`` takes it: ``(LoraSpec named name, tensors)``.

    Plain LoRA only: DoRA, per-module ranks or alphas (``rank_pattern``/``alpha_pattern``),
    ``modules_to_save``, ``fan_in_fan_out`` layers and ``target_modules`` given as a regular
    expression are refused (``ValueError``), and so is a folder that is not a readable adapter
    (no ``r``, values of the wrong type, a corrupt safetensors file). rsLoRA's ``alpha / sqrt(r)``
    scaling is kept by rescaling ``alpha``. Tensors are read with safetensors (no pickle)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    try:
        config: Any = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder} is not a PEFT adapter folder (adapter_config.json: {exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{folder / ADAPTER_CONFIG} must hold a JSON object (PEFT's LoraConfig), not "
                         f"{type(config).__name__}")
    unsupported = [key for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "fan_in_fan_out")
                   if config.get(key)]
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        unsupported.append(f"peft_type={config.get('peft_type')}")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets:
        unsupported.append("target_modules as a regular expression (list the module names)")
        targets = []
    if unsupported:
        raise ValueError(f"the PEFT adapter in {folder} uses what LoRA pushes do not carry: {', '.join(unsupported)}")
    try:
        lora = _PeftLoraConfig.model_validate(config)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{folder / ADAPTER_CONFIG} is not a usable LoRA config ({problems}); it needs the rank "
                         "'r' (an integer), and 'lora_alpha' a number if given, as PEFT's save_pretrained "
                         "writes them") from None
    alpha = float(lora.r if lora.lora_alpha is None else lora.lora_alpha)
    if lora.use_rslora:
        alpha *= math.sqrt(lora.r)  # PEFT scales by alpha / sqrt(r); LoraSpec.scaling is alpha / r
    spec = LoraSpec(name=name, rank=lora.r, alpha=alpha, target_modules=sorted(str(t) for t in targets))
    file = folder / ADAPTER_WEIGHTS
    if not file.is_file():
        raise ValueError(f"{folder} has no adapter_model.safetensors (save with safe_serialization=True)")
    try:
        return spec, load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{file} is not a readable safetensors file ({exc}); save the adapter again") from None


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def peft_adapter_config(spec: LoraSpec, base_model: str = "") -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for ``spec``: a plain LoRA adapter, as ``save_pretrained``
    writes it and vLLM's / SGLang's PEFT readers take it."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": spec.rank, "lora_alpha": spec.alpha, "target_modules": list(spec.target_modules),
        "bias": "none", "lora_dropout": 0.0, "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
        "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True,
    }


def save_peft_adapter(path: str | Path, spec: LoraSpec, tensors: Mapping[str, torch.Tensor], *,
                      base_model: str = "", config: Mapping[str, Any] | None = None) -> Path:
    """Write ``spec`` and its ``tensors`` (PEFT names) as a PEFT adapter folder at ``path``, the
    inverse of :func:`load_peft_adapter`; ``config`` overrides keys of the written config. A sibling
    folder (mode 0700) is written, then renamed into place (:func:`~.checkpoint.atomic_directory`; an
    existing folder there is replaced)."""
    from .checkpoint import atomic_directory

    with atomic_directory(path, replace=True) as tmp:
        write_adapter_config(tmp, spec, base_model=base_model, config=config)
        write_adapter_weights(tmp, tensors)
    return Path(path)


def write_adapter_config(folder: str | Path, spec: LoraSpec, *, base_model: str = "",
                         config: Mapping[str, Any] | None = None) -> Path:
    """Write ``adapter_config.json`` (:func:`peft_adapter_config`, ``config`` overriding keys) into
    the existing ``folder``; half of :func:`save_peft_adapter`, for a backend whose workers write
    the weights into a folder its driver prepared (:func:`write_adapter_weights`)."""
    file = Path(folder) / ADAPTER_CONFIG
    file.write_text(json.dumps({**peft_adapter_config(spec, base_model), **(config or {})}, indent=1))
    return file


def write_adapter_weights(folder: str | Path, tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write ``adapter_model.safetensors`` into the existing ``folder`` all at once (a temporary
    sibling file renamed into place, so a reader finds the whole file or none)."""
    import os
    import tempfile

    from safetensors.torch import save_file

    file = Path(folder) / ADAPTER_WEIGHTS
    host = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    fd, tmp = tempfile.mkstemp(prefix=f".{ADAPTER_WEIGHTS}.", dir=file.parent)
    os.close(fd)
    try:
        save_file(host, tmp, metadata={"format": "pt"})
        os.replace(tmp, file)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return file


def install_started() -> tuple[float, float]:
    """The clocks at the start of an adapter's install, for :func:`with_install_time` (called
    on the same thread): wall time and this thread's CPU time."""
    return time.perf_counter(), time.thread_time()


def with_install_time(timings: Mapping[str, float], started: tuple[float, float]) -> dict[str, float]:
    """A receiver's ``last_timings`` with the install since ``started`` (:func:`install_started`)
    added, as :class:`~rollout_engines.types.ReceiveTimings` reads them: ``install`` (wall, also
    added to ``total``) and ``install_cpu`` (this thread's CPU time in it; the rest of ``install``
    the thread waited: for Python's GIL, a lock, the device)."""
    seconds = time.perf_counter() - started[0]
    cpu = time.thread_time() - started[1]
    return {**timings, "install": round(seconds, 6), "install_cpu": round(cpu, 6),
            "total": round(timings.get("total", 0.0) + seconds, 6)}


# ---- test and benchmark adapters -------------------------------------------------------------------
#: Module names :func:`make_lora`'s adapters target, where the model has them (else the first two
#: projection-like linear layers it finds inside its decoder layers).
LORA_TARGETS = ("q_proj", "v_proj")


def lora_targets(weights: Mapping[str, torch.Tensor]) -> list[str]:
    """Module names (last components) an adapter of this model can target."""
    found = sorted({n[: -len(".weight")].rsplit(".", 1)[-1] for n, t in weights.items()
                    if n.endswith(".weight") and t.dim() == 2 and ".layers." in n})
    preferred = [m for m in LORA_TARGETS if m in found]
    return preferred or [m for m in found if m.endswith("proj")][:2] or found[:2]


def make_lora(weights: Mapping[str, torch.Tensor], name: str, *, rank: int = 8, seed: int = 0,
              targets: list[str] | None = None) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """A LoRA adapter for the model whose checkpoint is ``weights``: deterministic random ``A``
    and ``B`` (``B`` non-zero, unlike a fresh PEFT adapter, so it changes outputs), PEFT names, in
    the checkpoint's dtype, on the CPU. For tests and benchmarks. Returns ``(LoraSpec, tensors)``."""
    spec = LoraSpec(name=name, rank=rank, alpha=2.0 * rank, target_modules=targets or lora_targets(weights))
    base = {n: TensorSpec(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape))
            for n, t in weights.items() if t.dim() == 2}
    dtype = next(t.dtype for t in weights.values() if t.is_floating_point())
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(*e.shape, generator=gen).to(dtype) for n, e in
               lora_expected_specs(base, spec, "float32").items()}
    return spec, tensors


__all__ = [
    "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "LORA_TARGETS", "PEFT_PREFIX", "LoraTarget", "load_peft_adapter", "lora_expected_specs", "lora_problem",
    "lora_targets", "make_lora", "module_of", "peft_adapter_config", "receive_lora", "save_peft_adapter", "split_adapter",
    "target_weights",
]
