"""The remote backend pushing into a plain vLLM server through vLLM's own IPC weight-transfer engine
(no worker extension): ``--weight-transfer-config '{"backend": "ipc"}'`` with the development routes
and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (vLLM takes IPC handles only pickled over HTTP).

CUDA only (vLLM's weight-transfer engines all are); skipped elsewhere. The trainer's tensors and
the server share the GPU, as in a colocated RL job.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.remote, pytest.mark.vllm, pytest.mark.gpu, pytest.mark.timeout(900)]

if not torch.cuda.is_available():
    pytest.skip("vLLM's IPC weight-transfer engine needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

from rollout_engines import GenerateRequest, SamplingParams, create_engine  # noqa: E402
from rollout_engines.errors import ManifestMismatch  # noqa: E402
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed  # noqa: E402
from rollout_engines.weights.session import connect_weight_sync  # noqa: E402

from .test_vllm_server import PlainVllmServer  # noqa: E402

REQUEST = GenerateRequest(prompt_token_ids=[[5, 6, 7, 8], [17] * 9],
                          sampling=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlainVllmServer]:
    srv = PlainVllmServer(str(tiny_model), tmp_path_factory.mktemp("vllm-ipc") / "vllm.log", dtype="bfloat16",
                          worker_extension=False,
                          extra_args=["--weight-transfer-config", '{"backend": "ipc"}', "--gpu-memory-utilization", "0.2"],
                          env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    try:
        srv.wait()
        yield srv
    finally:
        srv.stop()


async def tokens(engine):
    return [c.token_ids for c in await engine.generate(REQUEST)]


async def push(engine, tensors, version):
    sync = await connect_weight_sync([engine], "cuda_ipc", timeout_s=120)
    try:
        return await sync.push(tensors, version=version)
    finally:
        await sync.close()


async def test_pushes_through_vllms_ipc_engine(server: PlainVllmServer, tiny_model: Path) -> None:
    engine = create_engine("remote", model=server.url, server="vllm")
    original = {k: v.cuda() for k, v in load_checkpoint(tiny_model, dtype=torch.bfloat16).items()}
    try:
        assert engine.capabilities.transports == ("cuda_ipc",)
        info = await engine.info()
        assert info.extra["weight_transfer"] == "vllm ipc engine"
        before = await tokens(engine)
        await push(engine, perturbed(original, scale=2.0), engine.weight_version + 1)
        assert engine.weight_version == 1
        changed = await tokens(engine)
        assert changed != before

        # A push the served checkpoint cannot take is refused before vLLM starts its reload.
        bad = dict(original)
        name = next(n for n in bad if n.endswith("mlp.down_proj.weight"))
        bad[name] = torch.zeros(bad[name].shape[0], bad[name].shape[1] + 1, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ManifestMismatch):
            await push(engine, bad, engine.weight_version + 1)
        assert engine.weight_version == 1 and await tokens(engine) == changed

        await push(engine, original, engine.weight_version + 1)
        assert engine.weight_version == 2
        assert await tokens(engine) == before
    finally:
        await engine.close()


async def test_other_transports_are_refused_with_the_way_out(server: PlainVllmServer) -> None:
    from rollout_engines.errors import CapabilityError, WeightSyncError

    engine = create_engine("remote", model=server.url, server="vllm")
    try:
        with pytest.raises((CapabilityError, WeightSyncError), match="cuda_ipc"):
            await connect_weight_sync([engine], "gloo", timeout_s=30)
    finally:
        await engine.close()
