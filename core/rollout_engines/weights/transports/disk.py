"""``disk``: one safetensors file per bucket in a (shared) directory, plus a manifest written last.

Layout of one update, in ``options['path']`` (default: a temporary directory)::

    v00000007-<token>/bucket-00000.safetensors   the bucket's named tensors; header in metadata
    v00000007-<token>/bucket-00001.safetensors
    v00000007-<token>/manifest.json              written last: the update is complete
    v00000007-<token>/ABORT                      only if the trainer gave the update up

Every file is written to a temporary name and moved into place with ``os.replace``, so a reader
never sees half a file. Receivers wait (with the timeout) for each bucket file. The trainer keeps
the newest ``options['keep']`` complete updates (default 2) and deletes older ones and aborted
ones. :func:`load_latest` reads the newest complete update back, for crash recovery.

Padding between tensors is not stored, so the sender zeroes it and recomputes the bucket's
checksum: the receiver rebuilds the same flat buffer from the named tensors and checks it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ...errors import WeightSyncError
from ..buckets import BucketHeader, bucket_views, checksum
from ..manifest import TransportSpec, WeightManifest
from ..transport import TransportReceiver, TransportSender
from ._store import TRAINER, poll

logger = logging.getLogger("rollout_engines.weights")

MANIFEST = "manifest.json"
ABORT = "ABORT"


def update_dir(root: str | Path, manifest: WeightManifest) -> Path:
    return Path(root) / f"v{manifest.version:08d}-{manifest.session_id[:16]}"


def bucket_file(directory: Path, index: int) -> Path:
    return directory / f"bucket-{index:05d}.safetensors"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class DiskSender(TransportSender):
    """Trainer half of ``disk``."""

    name: ClassVar[str] = "disk"

    def __init__(self, *, session_id: str, world_size: int, timeout_s: float, options: dict[str, Any]):
        super().__init__(session_id=session_id, world_size=world_size, timeout_s=timeout_s, options=options)
        path = self.options.get("path")
        self._temporary = path is None
        self.root = Path(path) if path is not None else Path(tempfile.mkdtemp(prefix="roe-weights-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = max(1, int(self.options.get("keep", 2)))
        self._manifest: WeightManifest | None = None
        self._dir: Path | None = None

    def spec_options(self) -> dict[str, Any]:
        return {"path": str(self.root)}

    def begin(self, manifest: WeightManifest) -> None:
        self._manifest = manifest
        self._dir = update_dir(self.root, manifest)
        self._dir.mkdir(parents=True, exist_ok=True)

    def send_bucket(self, header: BucketHeader, buf: torch.Tensor) -> None:
        assert self._manifest is not None and self._dir is not None
        manifest = self._manifest
        placements = manifest.bucket_tensors(header.index)
        flat = buf[: header.nbytes]
        # Zero the alignment gaps (the file does not carry them) and checksum what the receiver rebuilds.
        end = 0
        for p in placements:
            if p.offset > end:
                flat[end : p.offset].zero_()
            end = p.offset + p.nbytes
        if end < header.nbytes:
            flat[end:].zero_()
        header = header.model_copy(update={"checksum": checksum(flat, manifest.checksum)})
        tensors = dict(bucket_views(flat, placements))
        meta = {"header": header.model_dump_json(exclude={"ABORT"}), "version": str(manifest.version)}
        target = bucket_file(self._dir, header.index)
        tmp = target.with_name(f".{target.name}.tmp")
        try:
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, target)
        except OSError as exc:
            raise WeightSyncError(f"disk: could not write {target}: {exc}", bucket=header.index) from exc

    def end(self, manifest: WeightManifest) -> None:
        assert self._dir is not None
        _atomic_write_text(self._dir / MANIFEST, manifest.model_dump_json())
        self._prune()

    def _prune(self) -> None:
        # Newest first by when the update completed; the update just written is always kept.
        complete = sorted(
            (d for d in self.root.iterdir() if (d / MANIFEST).exists() and d != self._dir),
            key=lambda d: (d / MANIFEST).stat().st_mtime_ns, reverse=True,
        )
        aborted = [d for d in self.root.iterdir() if (d / ABORT).exists() and d != self._dir]
        for old in complete[self.keep - 1 :] + aborted:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self, reason: str) -> None:
        if self._dir is None:
            return
        _atomic_write_text(self._dir / ABORT, reason[:1000])

    def close(self) -> None:
        if self._temporary:
            shutil.rmtree(self.root, ignore_errors=True)


class DiskReceiver(TransportReceiver):
    """Engine-worker half of ``disk``: waits for each bucket file and rebuilds the bucket."""

    name: ClassVar[str] = "disk"
    keeps_buffer: ClassVar[bool] = True

    def __init__(self, spec: TransportSpec, *, rank: int, device: torch.device | str = "cpu"):
        super().__init__(spec, rank=rank, device=device)
        self.root = Path(spec.options["path"])
        self._dir: Path | None = None
        self._manifest: WeightManifest | None = None

    def begin(self, manifest: WeightManifest) -> None:
        self._manifest = manifest
        self._dir = update_dir(self.root, manifest)

    def _check(self, index: int) -> None:
        assert self._dir is not None
        abort = self._dir / ABORT
        if abort.exists():
            raise WeightSyncError(f"disk: the trainer aborted the update: {abort.read_text()}", peer=TRAINER, bucket=index)

    def recv_bucket(self, index: int, nbytes: int) -> tuple[BucketHeader, torch.Tensor]:
        assert self._dir is not None and self._manifest is not None
        path = bucket_file(self._dir, index)
        poll(
            path.exists, timeout_s=self.timeout_s, check=lambda: self._check(index),
            on_timeout=lambda: WeightSyncError(
                f"disk: {path} did not appear within {self.timeout_s:.0f} s", peer=TRAINER, bucket=index
            ),
        )
        try:
            header, buf = read_bucket(path, self._manifest, index)
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(f"disk: could not read {path}: {exc}", peer=TRAINER, bucket=index) from exc
        return header, buf.to(self.device) if buf.device != self.device else buf


def read_bucket(path: Path, manifest: WeightManifest, index: int) -> tuple[BucketHeader, torch.Tensor]:
    """Rebuild bucket ``index``'s flat buffer (zero padding) from its file."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        header = BucketHeader.model_validate_json(meta["header"])
        buf = torch.zeros(header.nbytes, dtype=torch.uint8)
        for name, view in bucket_views(buf, manifest.bucket_tensors(index)):
            view.copy_(f.get_tensor(name))
    return header, buf


def load_latest(root: str | Path) -> tuple[WeightManifest, dict[str, torch.Tensor]] | None:
    """The newest complete update in ``root`` (manifest and tensors by name), or None.

    Use it after a crash to restart an engine (or a trainer) from the last weights that were
    fully written; updates without ``manifest.json`` (interrupted) or with ``ABORT`` are skipped.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    candidates = []
    for d in root.iterdir():
        if (d / MANIFEST).exists() and not (d / ABORT).exists():
            m = WeightManifest.model_validate_json((d / MANIFEST).read_text())
            candidates.append((m.version, (d / MANIFEST).stat().st_mtime, d, m))
    if not candidates:
        return None
    _, _, directory, manifest = max(candidates, key=lambda c: (c[0], c[1]))
    tensors: dict[str, torch.Tensor] = {}
    for bucket in manifest.buckets:
        header, buf = read_bucket(bucket_file(directory, bucket.index), manifest, bucket.index)
        if checksum(buf, manifest.checksum) != header.checksum:
            raise WeightSyncError(f"disk: checksum mismatch in {directory}", bucket=bucket.index)
        tensors.update(bucket_views(buf, manifest.bucket_tensors(bucket.index)))
    return manifest, tensors
