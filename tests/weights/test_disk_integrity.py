"""The ``disk`` transport refuses what does not belong to the update it receives: stale buckets from
an earlier update, reshaped tensors, symlinks (bucket files, ABORT, the update directory), and it
never echoes a file's contents. Real files, the real DiskSender/DiskReceiver pair, and the real
transformers engine on the tiny model."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from rollout_engines import GenerateRequest, LoraSpec, SamplingParams, WeightSyncError, create_engine
from rollout_engines.weights.buckets import BucketHeader, alloc_bucket, checksum, pack_bucket
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed
from rollout_engines.weights.manifest import DeltaSpec, TransportSpec, WeightManifest, plan_manifest, specs_of
from rollout_engines.weights.session import connect_weight_sync
from rollout_engines.weights.transports import disk
from rollout_engines.weights.transports.disk import DiskReceiver, DiskSender, load_latest, update_dir
from safetensors import safe_open
from safetensors.torch import save_file

pytestmark = pytest.mark.timeout(120)

SECRET = "root-only-secret-7f3a9c"
TIMEOUT_S = 5.0


def model(seed: int) -> dict[str, torch.Tensor]:
    """A small state dict of several buckets (256-byte buckets: one or two tensors each)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(8, 4, generator=gen),
        "b.weight": torch.randn(16, generator=gen),
        "c.bias": torch.randn(3, generator=gen),
        "d.index": torch.arange(6, dtype=torch.int32) + seed,
    }


def plan(tensors: dict[str, torch.Tensor], version: int, **flags: Any) -> WeightManifest:
    """``flags``: plan_manifest's ``partial``, ``delta``, ``lora``."""
    return plan_manifest(specs_of(list(tensors.items())), version=version, bucket_bytes=256, transport="disk", **flags)


def sender_at(root: Path, keep: int = 5) -> DiskSender:
    return DiskSender(session_id="s", world_size=2, timeout_s=TIMEOUT_S, options={"path": str(root), "keep": keep})


def receiver_for(sender: DiskSender, timeout_s: float = TIMEOUT_S) -> DiskReceiver:
    spec = TransportSpec(transport="disk", session_id="s", timeout_s=timeout_s, options=sender.spec_options())
    return DiskReceiver(spec, rank=1)


def send(sender: DiskSender, tensors: dict[str, torch.Tensor], version: int, **flags: Any) -> WeightManifest:
    """One complete update, as WeightSync streams it."""
    manifest = plan(tensors, version, **flags)
    sender.begin(manifest)
    for bucket in manifest.buckets:
        buf = pack_bucket(manifest, bucket.index, tensors, alloc_bucket(bucket.nbytes))
        sender.send_bucket(BucketHeader(index=bucket.index, nbytes=bucket.nbytes, checksum=checksum(buf)), buf)
    sender.end(manifest)
    return manifest


def bucket_of(manifest: WeightManifest, name: str) -> int:
    return next(t.bucket for t in manifest.tensors if t.name == name)


# ---- stale buckets ---------------------------------------------------------------------------------


@pytest.mark.transformers
async def test_stale_bucket_copied_into_the_next_update_is_refused_and_v1_keeps_serving(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    request = GenerateRequest(
        prompts=["The quick brown fox", "Once", "def add(a, b):"],
        sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    )
    engine = create_engine("transformers", model=str(tiny_model), dtype="float32")
    try:
        original = load_checkpoint(tiny_model)
        v1, v2 = perturbed(original, seed=1), perturbed(original, seed=2)
        for v in (v1, v2):  # a complete push: the tied output head under its own name as well
            v.setdefault("lm_head.weight", v["model.embed_tokens.weight"])
        sync = await connect_weight_sync([engine], "disk", bucket_bytes=2**18, timeout_s=30,
                                         options={"path": str(tmp_path), "keep": 4})
        try:
            await sync.push(v1, version=1)
            served_v1 = [c.token_ids for c in await engine.generate(request)]
            (v1_dir,) = tmp_path.glob("v00000001-*")

            received = threading.Event()  # set once the engine is done with update v2 (either way)
            real_receive = engine.receive_weights

            async def receive_weights(manifest: WeightManifest) -> int:
                try:
                    return await real_receive(manifest)
                finally:
                    received.set()

            monkeypatch.setattr(engine, "receive_weights", receive_weights)

            def items():  # type: ignore[no-untyped-def]
                # The sender made v2's directory before asking for the first tensor: plant v1's
                # bucket 0 there (atomically, as a trainer's copy would land), and hold the real
                # one back until the engine has read what it found.
                (v2_dir,) = tmp_path.glob("v00000002-*")
                shutil.copyfile(v1_dir / "bucket-00000.safetensors", v2_dir / ".planted")
                os.replace(v2_dir / ".planted", v2_dir / "bucket-00000.safetensors")
                if not received.wait(30):
                    raise RuntimeError("the engine never finished reading the planted bucket")
                yield from v2.items()

            with pytest.raises(WeightSyncError) as info:
                await sync.push(items(), version=2, specs=specs_of(list(v2.items())))
            ((_, engine_error),) = info.value.failures  # type: ignore[attr-defined]
            message = str(engine_error)
            assert "bucket-00000.safetensors" in message and "another update" in message, message
            assert "version '1'" in message and "bucket: 0" in message, message
            # Nothing of v1's bucket reached the model as part of "v2": v1 still serves, as v1.
            assert [c.token_ids for c in await engine.generate(request)] == served_v1
            assert (await engine.info()).weight_version == 1

            monkeypatch.undo()
            await sync.push(v2, version=3)  # the session recovers with a clean update
            assert [c.token_ids for c in await engine.generate(request)] != served_v1
            assert (await engine.info()).weight_version == 3
        finally:
            await sync.close()
    finally:
        await engine.close()


def test_stale_bucket_is_refused_by_the_receiver_and_skipped_by_load_latest(tmp_path: Path) -> None:
    sender = sender_at(tmp_path)
    m1 = send(sender, model(1), version=1)
    m2 = send(sender, model(2), version=2)
    assert len(m2.buckets) >= 3
    # Same layout, same size: only the file's metadata tells the stale bucket apart.
    shutil.copyfile(update_dir(tmp_path, m1) / "bucket-00001.safetensors", update_dir(tmp_path, m2) / "x.part")
    os.replace(update_dir(tmp_path, m2) / "x.part", update_dir(tmp_path, m2) / "bucket-00001.safetensors")
    receiver = receiver_for(sender)
    receiver.begin(m2)
    receiver.recv_bucket(0, m2.buckets[0].nbytes)
    with pytest.raises(WeightSyncError) as info:
        receiver.recv_bucket(1, m2.buckets[1].nbytes)
    message = str(info.value)
    assert "bucket-00001.safetensors" in message and "stale" in message and "bucket: 1" in message
    assert m1.session_id in message and m2.session_id in message  # which update it came from, and which was due
    # A bucket misplaced inside its own update (bucket 2's file under bucket 1's name) is refused too.
    d2 = update_dir(tmp_path, m2)
    shutil.copyfile(d2 / "bucket-00002.safetensors", d2 / "bucket-00001.safetensors")
    with pytest.raises(WeightSyncError, match="bucket '2', expected '1'"):
        receiver.recv_bucket(1, m2.buckets[1].nbytes)
    receiver.close()
    latest = load_latest(tmp_path)
    assert latest is not None and latest[0].version == 1
    assert all(torch.equal(latest[1][n], t) for n, t in model(1).items())


# ---- shapes and dtypes in the file -------------------------------------------------------------------


def rewrite_bucket(path: Path, change: dict[str, torch.Tensor]) -> None:
    """Rewrite a bucket file with some tensors replaced, keeping its metadata (header, checksum)."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    tensors.update(change)
    save_file(tensors, str(path), metadata=meta)


def test_wrong_shape_in_the_file_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    sender = sender_at(tmp_path)
    tensors = model(3)
    manifest = send(sender, tensors, version=1)
    index = bucket_of(manifest, "a.weight")
    path = update_dir(tmp_path, manifest) / f"bucket-{index:05d}.safetensors"
    # Same bytes, so the same checksum: only the shape check can tell.
    rewrite_bucket(path, {"a.weight": tensors["a.weight"].reshape(4, 8).contiguous()})
    receiver = receiver_for(sender)
    receiver.begin(manifest)
    with pytest.raises(WeightSyncError) as info:
        receiver.recv_bucket(index, manifest.buckets[index].nbytes)
    message = str(info.value)
    assert "'a.weight': shape [4, 8] in the file, [8, 4] in the manifest" in message, message
    assert str(path) in message and f"bucket: {index}" in message

    # A dtype of the same size (int32 bits in a float32 slot) is refused as well.
    rewrite_bucket(path, {"a.weight": tensors["a.weight"].view(torch.int32)})
    with pytest.raises(WeightSyncError, match=r"'a.weight': dtype 'I32' in the file, float32 \(F32\)"):
        receiver.recv_bucket(index, manifest.buckets[index].nbytes)
    # So is an extra tensor slipped into the file.
    rewrite_bucket(path, {"a.weight": tensors["a.weight"], "smuggled.weight": torch.zeros(2)})
    with pytest.raises(WeightSyncError, match="not in this bucket, e.g. 'smuggled.weight'"):
        receiver.recv_bucket(index, manifest.buckets[index].nbytes)
    receiver.close()
    assert load_latest(tmp_path) is None  # the only update is broken: nothing to recover


# ---- symlinks and ABORT -------------------------------------------------------------------------------


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret.txt"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return path


def wait_refused(receiver: DiskReceiver, manifest: WeightManifest, index: int = 0) -> str:
    """recv_bucket's error, which must come well before the receiver's timeout."""
    receiver.begin(manifest)
    start = time.monotonic()
    with pytest.raises(WeightSyncError) as info:
        receiver.recv_bucket(index, manifest.buckets[index].nbytes)
    assert time.monotonic() - start < TIMEOUT_S - 1, "refused only by the timeout"
    receiver.end(manifest, ok=False)
    return str(info.value)


def test_symlinked_abort_is_refused_without_reading_the_target(tmp_path: Path, secret: Path) -> None:
    sender = sender_at(tmp_path / "root")
    manifest = plan(model(1), version=1)
    sender.begin(manifest)
    abort = update_dir(sender.root, manifest) / "ABORT"
    abort.symlink_to(secret)
    message = wait_refused(receiver_for(sender), manifest)
    assert SECRET not in message, message
    assert "ABORT is a symlink; refused" in message and "peer: trainer" in message, message

    # A regular ABORT file that is not the trainer's note is not echoed either.
    abort.unlink()
    abort.write_text(SECRET)
    message = wait_refused(receiver_for(sender), manifest)
    assert SECRET not in message and "not the trainer's abort note" in message, message

    # A FIFO under the name cannot hang the receiver (opened non-blocking, refused as not a file).
    abort.unlink()
    os.mkfifo(abort)
    message = wait_refused(receiver_for(sender), manifest)
    assert "is not a regular file; refused" in message, message


def test_trainer_abort_reason_is_shown_sanitised_and_bounded(tmp_path: Path) -> None:
    sender = sender_at(tmp_path)
    manifest = plan(model(1), version=1)
    sender.begin(manifest)
    sender.abort("RuntimeError: gather failed\x1b[31m\n\x00" + "x" * 5000)
    assert (update_dir(tmp_path, manifest) / "ABORT").stat().st_size <= disk.ABORT_MAX_BYTES
    message = wait_refused(receiver_for(sender), manifest)
    assert "the trainer aborted update v1: RuntimeError: gather failed" in message, message
    assert "\x1b" not in message and "\x00" not in message and "\n" not in message
    assert len(message) < 600


def test_symlinked_bucket_file_is_refused(tmp_path: Path, secret: Path) -> None:
    sender = sender_at(tmp_path / "root")
    m1 = send(sender, model(1), version=1)
    m2 = plan(model(2), version=2)
    sender.begin(m2)
    target = update_dir(sender.root, m2) / "bucket-00000.safetensors"
    # A link to a real bucket file (v1's) and a link to a secret: both refused, neither read.
    for pointee in (update_dir(sender.root, m1) / "bucket-00000.safetensors", secret):
        target.unlink(missing_ok=True)
        target.symlink_to(pointee)
        message = wait_refused(receiver_for(sender), m2)
        assert "bucket 0 file" in message and "is a symlink; refused" in message, message
        assert SECRET not in message
    # A dangling link is refused at once too, not waited for until the timeout.
    target.unlink()
    target.symlink_to(tmp_path / "nowhere")
    assert "is a symlink; refused" in wait_refused(receiver_for(sender), m2)


def test_symlinked_update_directory_is_refused(tmp_path: Path) -> None:
    sender = sender_at(tmp_path / "root")
    manifest = send(sender, model(1), version=1)
    real = update_dir(sender.root, manifest)
    # The next update's directory is a link to a complete directory of valid-looking files.
    m2 = manifest.model_copy(update={"version": 2, "session_id": uuid.uuid4().hex})
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(real, elsewhere)
    update_dir(sender.root, m2).symlink_to(elsewhere, target_is_directory=True)
    message = wait_refused(receiver_for(sender), m2)
    assert "update directory" in message and "is a symlink; refused" in message, message
    with pytest.raises(WeightSyncError, match="is a symlink; refused"):
        sender.begin(m2)  # the trainer does not write through it either
    latest = load_latest(sender.root)
    assert latest is not None and latest[0].version == 1


# ---- crash recovery -------------------------------------------------------------------------------------


def test_load_latest_skips_broken_updates_and_returns_the_newest_complete_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sender = sender_at(tmp_path, keep=10)
    manifests = {v: send(sender, model(v), version=v) for v in (1, 2, 3, 4, 5)}
    assert load_latest(tmp_path)[0].version == 5  # type: ignore[index]
    # v5: the manifest is garbage; v4: a bucket's data corrupted (checksum); v3: a bucket missing.
    (update_dir(tmp_path, manifests[5]) / "manifest.json").write_text('{"version": 5, "tensors": [')
    corrupt = update_dir(tmp_path, manifests[4]) / "bucket-00000.safetensors"
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    (update_dir(tmp_path, manifests[3]) / "bucket-00001.safetensors").unlink()
    with caplog.at_level(logging.WARNING, logger="rollout_engines.weights"):
        latest = load_latest(tmp_path)
    assert latest is not None
    manifest, tensors = latest
    assert manifest.version == 2 and manifest.session_id == manifests[2].session_id
    for name, t in model(2).items():
        assert torch.equal(tensors[name], t)
    skipped = " ".join(r.getMessage() for r in caplog.records)
    for v in (5, 4, 3):
        assert update_dir(tmp_path, manifests[v]).name in skipped, skipped
    assert "not a valid manifest" in skipped and "checksum mismatch" in skipped
    # A manifest that is a symlink (here to the update's own, valid, manifest) is refused: with v2's
    # and v1's linked, nothing valid is left.
    for v in (2, 1):
        path = update_dir(tmp_path, manifests[v]) / "manifest.json"
        path.rename(path.with_name("real.json"))
        path.symlink_to(path.with_name("real.json"))
    assert load_latest(tmp_path) is None


NOT_FULL: dict[str, dict[str, Any]] = {
    "delta": {"delta": DeltaSpec(base_version=1)},
    "partial": {"partial": True},
    "lora": {"lora": LoraSpec(name="policy", rank=2, alpha=4.0, target_modules=["a"])},
}


@pytest.mark.parametrize("kind", sorted(NOT_FULL))
def test_load_latest_returns_the_newest_full_update_not_a_newer_delta_partial_or_lora(tmp_path: Path, kind: str) -> None:
    sender = sender_at(tmp_path)
    full = model(1)
    send(sender, full, version=1)
    send(sender, {"a.weight": full["a.weight"] + 1}, version=2, **NOT_FULL[kind])
    latest = load_latest(tmp_path)
    assert latest is not None
    manifest, tensors = latest
    assert manifest.version == 1 and set(tensors) == set(full)
    assert all(torch.equal(tensors[n], t) for n, t in full.items())


@pytest.mark.parametrize("kind", sorted(NOT_FULL))
def test_pruning_keeps_the_newest_full_update_behind_newer_deltas_partials_and_loras(tmp_path: Path, kind: str) -> None:
    sender = sender_at(tmp_path, keep=2)
    full = model(1)
    first = send(sender, full, version=1)
    pushes = [send(sender, {"a.weight": full["a.weight"] + v}, version=v, **NOT_FULL[kind]) for v in (2, 3, 4)]
    left = {p.name for p in tmp_path.iterdir()}
    # The base to restart from, and the newest ``keep`` updates; v2 goes.
    assert left == {update_dir(tmp_path, m).name for m in (first, *pushes[-2:])}
    latest = load_latest(tmp_path)
    assert latest is not None and latest[0].version == 1
    # Full updates count toward ``keep``: two newer ones push v1 out (with the run after it).
    fulls = [send(sender, full, version=v) for v in (5, 6)]
    assert {p.name for p in tmp_path.iterdir()} == {update_dir(tmp_path, m).name for m in fulls}
    assert load_latest(tmp_path)[0].version == 6  # type: ignore[index]


def test_files_are_synced_before_the_rename_and_the_manifest_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to name the synced files")
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("replace", f"{os.fspath(src)} -> {os.fspath(dst)}"))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    sender = sender_at(tmp_path)
    manifest = send(sender, model(1), version=1)
    monkeypatch.undo()
    directory = str(update_dir(tmp_path, manifest).resolve())
    replaces = [i for i, (kind, _) in enumerate(events) if kind == "replace"]
    assert len(replaces) == len(manifest.buckets) + 1
    for i in replaces:
        src, dst = events[i][1].split(" -> ")
        assert events[i - 1] == ("fsync", str(Path(src).resolve())), events  # the file, before its rename
        assert events[i + 1] == ("fsync", directory), events  # the directory, after it
    assert events[replaces[-1]][1].endswith("manifest.json")  # written last
    assert all(not events[i][1].endswith("manifest.json") for i in replaces[:-1])
