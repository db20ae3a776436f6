"""``disk``: one safetensors file per bucket in a (shared) directory, plus a manifest written last.

Layout of one update, in ``options['path']`` (default: a temporary directory)::

    v00000007-<token>/bucket-00000.safetensors   the bucket's named tensors; header in metadata
    v00000007-<token>/bucket-00001.safetensors
    v00000007-<token>/manifest.json              written last: the update is complete
    v00000007-<token>/ABORT                      only if the trainer gave the update up

``<token>`` is the start of the update's token (``manifest.session_id``), new for every push.

Writing (trainer). Every file is written under a temporary name (``.<name>.<random>.part``, created
exclusively), fsynced, moved into place with ``os.replace`` and the directory fsynced after the
rename, so a reader never sees half a file and a crash never leaves a manifest pointing at
unwritten buckets: ``manifest.json`` is written last, the same way. (``options['fsync']``, default
True for a given ``path``, False for the temporary directory that is deleted at close anyway.) The trainer keeps the newest ``options['keep']``
complete updates (default 2) and, besides them, the newest ``keep`` full ones (what
:func:`load_latest` restarts from, so a run of delta, partial or LoRA pushes never deletes its
base); it deletes older ones and aborted ones (only directories named like updates, never symlinks).

Reading (engine workers and :func:`load_latest`). Nothing is trusted because it is in the directory:

- no symlinks: the update directory, bucket files, ``manifest.json`` and ``ABORT`` are opened with
  ``O_NOFOLLOW`` (files relative to the opened directory) and must be a directory or regular files
  (checked on the open descriptor, so a swap after the check changes nothing; ``O_NONBLOCK`` so a
  FIFO cannot hang the reader); anything else is refused with a :class:`WeightSyncError`;
- a bucket file belongs to its update: its metadata carries the update's version, token and bucket
  index, and every tensor in it must be one of the manifest's placements for that bucket with the
  same name, dtype, shape and size (nothing missing, nothing extra). A stale bucket (from an earlier
  update, e.g. copied into this one's directory) or a reshaped one is refused, naming the file, the
  bucket and what differs, never the file's contents; the bucket's checksum is then checked against
  the rebuilt buffer by the receiver (and by :func:`load_latest`);
- ``ABORT``: at most 512 bytes of a regular file are read, and only the trainer's own short reason
  (JSON with this update's token) is echoed, reduced to printable characters and bounded; any
  other content is never shown.

Receivers wait (with the timeout) for each bucket file. :func:`load_latest` reads the newest
complete, valid full update back, for crash recovery, skipping broken ones with a logged warning.

Padding between tensors is not stored, so the sender zeroes it and recomputes the bucket's
checksum: the receiver rebuilds the same flat buffer from the named tensors and checks it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from ...errors import WeightSyncError
from ..buckets import BucketHeader, bucket_views, checksum
from ..manifest import TensorPlacement, TransportSpec, WeightManifest
from ._store import TRAINER, poll
from .base import TransportReceiver, TransportSender

logger = logging.getLogger("rollout_engines.weights")

MANIFEST = "manifest.json"
ABORT = "ABORT"
#: What a bucket file's metadata says it is (``format`` key); files of other formats are refused.
FORMAT = "rollout-engines-disk/2"
#: The most of an ABORT file that is ever read, and of its reason that is ever shown.
ABORT_MAX_BYTES = 512
REASON_MAX_CHARS = 300
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
_MAX_MANIFEST_BYTES = 256 * 2**20
_UPDATE_NAME = re.compile(r"v-?\d{8,}-[A-Za-z0-9_-]{1,64}")
_SHOWABLE = re.compile(r"[A-Za-z0-9_.:/-]{1,96}")

#: The manifest's dtype names as safetensors spells them.
SAFETENSORS_DTYPES = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIR_FD = os.open in os.supports_dir_fd and os.stat in os.supports_dir_fd


def update_dir(root: str | Path, manifest: WeightManifest) -> Path:
    return Path(root) / f"v{manifest.version:08d}-{manifest.session_id[:16]}"


def bucket_name(index: int) -> str:
    return f"bucket-{index:05d}.safetensors"


def bucket_file(directory: Path, index: int) -> Path:
    return directory / bucket_name(index)


def _show(value: object) -> str:
    """A value read from a file, quoted only if it is short and plain (a version, a token, a
    tensor name); anything else is not echoed."""
    text = str(value)
    return repr(text) if _SHOWABLE.fullmatch(text) else "(an unexpected value, not shown)"


def sanitize_reason(text: str, limit: int = REASON_MAX_CHARS) -> str:
    """``text`` reduced to printable characters (others become spaces) and at most ``limit`` of them."""
    clean = "".join(c if c.isprintable() else " " for c in text[: limit * 2])
    clean = " ".join(clean.split())
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


# ---- opening without following symlinks -----------------------------------------------------------


class UpdateDir:
    """An update directory opened without following a symlink; files are opened relative to it
    (``O_NOFOLLOW``, regular files only), so neither the directory nor a file can be swapped for a
    link to somewhere else."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) or os.path.islink(path):
                kind = "a symlink" if os.path.islink(path) else "not a directory"
                raise WeightSyncError(f"disk: the update directory {path} is {kind}; refused") from None
            raise
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                raise WeightSyncError(f"disk: the update directory {path} is not a directory; refused")
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd

    def __enter__(self) -> UpdateDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def lstat(self, name: str) -> os.stat_result | None:
        """The entry ``name`` itself (a symlink is not followed), or None when there is none."""
        try:
            if _DIR_FD and self.fd is not None:
                return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            return os.lstat(self.path / name)
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        return self.lstat(name) is not None

    def open_regular(self, name: str, what: str) -> int:
        """A read-only descriptor of the regular file ``name``; a symlink, FIFO, device or directory
        is refused with a WeightSyncError naming the path (and nothing of what it points to)."""
        path = self.path / name
        flags = os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK
        try:
            if _DIR_FD and self.fd is not None:
                fd = os.open(name, flags, dir_fd=self.fd)
            else:
                fd = os.open(path, flags)
        except OSError as exc:
            entry = self.lstat(name)
            if exc.errno == errno.ELOOP or (entry is not None and stat.S_ISLNK(entry.st_mode)):
                raise WeightSyncError(f"disk: {what} {path} is a symlink; refused (it must be a regular file)") from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise WeightSyncError(f"disk: {what} {path} is not a regular file; refused")
            if _O_NONBLOCK:
                os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    got = 0
    while got < len(view):
        rest = view[got:]
        n = os.preadv(fd, [rest], offset + got) if hasattr(os, "preadv") else _pread_copy(fd, rest, offset + got)
        if n <= 0:
            raise EOFError("the file ended early")
        got += n


def _pread_copy(fd: int, view: memoryview, offset: int) -> int:
    data = os.pread(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    out = bytearray(n)
    _pread_into(fd, memoryview(out), offset)
    return bytes(out)


# ---- writing durably -------------------------------------------------------------------------------


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems cannot sync a directory; the files themselves are synced
        logger.debug("disk: could not fsync %s: %s", directory, exc)
    finally:
        os.close(fd)


def _write_durable(directory: Path, name: str, write: Callable[[int, str], None], *, fsync: bool) -> None:
    """Write ``name`` in ``directory`` through a fresh temporary file (created exclusively, never
    through a symlink), fsync it, rename it into place and fsync the directory."""
    tmp = directory / f".{name}.{secrets.token_hex(6)}.part"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o666)
    try:
        try:
            write(fd, str(tmp))
        finally:
            os.close(fd)
        if fsync:
            # Reopened: a writer given the path (safetensors) may have replaced the file we created.
            fd = os.open(tmp, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        _fsync_dir(directory)


def _write_bytes(data: bytes) -> Callable[[int, str], None]:
    def write(fd: int, _path: str) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    return write


def _save_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Callable[[int, str], None]:
    def write(_fd: int, path: str) -> None:
        save_file(tensors, path, metadata=meta)  # at the name created exclusively above

    return write


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
        self.fsync = bool(self.options.get("fsync", not self._temporary))  # a scratch directory needs no durability
        self._manifest: WeightManifest | None = None
        self._dir: Path | None = None

    def spec_options(self) -> dict[str, Any]:
        return {"path": str(self.root)}

    def begin(self, manifest: WeightManifest) -> None:
        self._manifest = manifest
        self._dir = update_dir(self.root, manifest)
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise WeightSyncError(f"disk: could not create {self._dir}: {exc}") from exc
        UpdateDir(self._dir).close()  # refuses a symlink or a file planted under the update's name
        if self.fsync:
            _fsync_dir(self.root)

    def send_bucket(self, header: BucketHeader, buf: torch.Tensor) -> None:
        assert self._manifest is not None and self._dir is not None
        self.raise_if_cancelled(header.index)  # an engine refused the update: stop writing it
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
        if tensors and next(iter(tensors.values())).device.type != "cpu":
            tensors = {n: t.cpu() for n, t in tensors.items()}
        meta = {
            "format": FORMAT,
            "header": header.model_dump_json(),
            "version": str(manifest.version),
            "update": manifest.session_id,
            "bucket": str(header.index),
        }
        try:
            _write_durable(self._dir, bucket_name(header.index), _save_tensors(tensors, meta), fsync=self.fsync)
        except OSError as exc:
            raise WeightSyncError(
                f"disk: could not write {bucket_file(self._dir, header.index)}: {exc}", bucket=header.index
            ) from exc

    def end(self, manifest: WeightManifest) -> None:
        assert self._dir is not None
        # Every bucket is synced and renamed into place (and the directory synced) by now: the
        # manifest, written last, never points at unwritten buckets.
        _write_durable(self._dir, MANIFEST, _write_bytes(manifest.model_dump_json().encode()), fsync=self.fsync)
        self._prune()

    def _updates(self) -> list[Path]:
        """Directories of ``root`` named like updates (never symlinks), except the current one."""
        out = []
        for d in self.root.iterdir():
            if d == self._dir or not _UPDATE_NAME.fullmatch(d.name):
                continue
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.lstat(d).st_mode):
                    out.append(d)
        return out

    def _prune(self) -> None:
        # Two windows, newest first by when the update completed: the newest ``keep`` full updates
        # (what load_latest recovers from: a run of deltas never pushes its base out) and the newest
        # ``keep`` updates of any kind, each window counting the update just written (not listed
        # here); the rest are deleted.
        complete: list[tuple[int, bool, Path]] = []
        aborted: list[Path] = []
        for d in self._updates():
            with contextlib.suppress(OSError):
                if os.path.lexists(d / ABORT):
                    aborted.append(d)
                elif os.path.lexists(d / MANIFEST):
                    complete.append((os.lstat(d / MANIFEST).st_mtime_ns, _holds_full_update(d), d))
        complete.sort(key=lambda c: c[0], reverse=True)
        assert self._manifest is not None
        newest = [d for _, _, d in complete]
        fulls = [d for _, full, d in complete if full][: self.keep - (1 if is_full_update(self._manifest) else 0)]
        kept = set(newest[: self.keep - 1]) | set(fulls)
        for old in [d for d in newest if d not in kept] + aborted:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self, reason: str) -> None:
        if self._dir is None or self._manifest is None:
            return
        note = {"update": self._manifest.session_id, "version": self._manifest.version, "reason": ""}
        text = sanitize_reason(reason)
        data = b""
        while True:  # bounded: the receiver reads at most ABORT_MAX_BYTES
            note["reason"] = text
            data = json.dumps(note).encode()
            if len(data) <= ABORT_MAX_BYTES or not text:
                break
            text = text[: len(text) * 3 // 4]
        _write_durable(self._dir, ABORT, _write_bytes(data), fsync=self.fsync)

    def close(self) -> None:
        if self._temporary:
            shutil.rmtree(self.root, ignore_errors=True)


class DiskReceiver(TransportReceiver):
    """Engine-worker half of ``disk``: waits for each bucket file, checks it belongs to this update
    and matches the manifest, and rebuilds the bucket."""

    name: ClassVar[str] = "disk"
    keeps_buffer: ClassVar[bool] = True

    def __init__(self, spec: TransportSpec, *, rank: int, device: torch.device | str = "cpu"):
        super().__init__(spec, rank=rank, device=device)
        self.root = Path(spec.options["path"])
        self._dir: Path | None = None
        self._handle: UpdateDir | None = None
        self._manifest: WeightManifest | None = None

    def begin(self, manifest: WeightManifest) -> None:
        self._close_handle()
        self._manifest = manifest
        self._dir = update_dir(self.root, manifest)

    def _opened(self) -> UpdateDir | None:
        """The update directory, opened once it exists (a symlink there is refused)."""
        if self._handle is None:
            assert self._dir is not None
            if not os.path.lexists(self._dir):
                return None
            try:
                self._handle = UpdateDir(self._dir)
            except OSError as exc:
                raise WeightSyncError(f"disk: could not open {self._dir}: {exc.strerror}", peer=TRAINER) from None
        return self._handle

    def _check(self, index: int) -> None:
        self.raise_if_cancelled(index)
        handle = self._opened()
        if handle is None or not handle.exists(ABORT):
            return
        assert self._manifest is not None
        version = self._manifest.version
        try:
            reason = abort_reason(handle, self._manifest)
        except WeightSyncError as exc:  # not a file the trainer wrote: nothing of it is read or shown
            raise WeightSyncError(f"{exc}; update v{version} is given up", peer=TRAINER, bucket=index) from None
        raise WeightSyncError(f"disk: the trainer aborted update v{version}: {reason}", peer=TRAINER, bucket=index)

    def _arrived(self, index: int) -> bool:
        handle = self._opened()
        return handle is not None and handle.exists(bucket_name(index))

    def recv_bucket(self, index: int, nbytes: int) -> tuple[BucketHeader, torch.Tensor]:
        assert self._dir is not None and self._manifest is not None
        path = bucket_file(self._dir, index)
        poll(
            lambda: self._arrived(index), timeout_s=self.timeout_s, check=lambda: self._check(index),
            on_timeout=lambda: WeightSyncError(
                f"disk: {path} did not appear within {self.timeout_s:.0f} s", peer=TRAINER, bucket=index
            ),
            bucket=index,
        )
        handle = self._opened()
        assert handle is not None
        try:
            header, buf = _read_bucket(handle, self._manifest, index)
        except WeightSyncError:
            raise
        except Exception as exc:  # the message names the error, never the file's contents
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise WeightSyncError(f"disk: could not read {path}: {detail}", peer=TRAINER, bucket=index) from exc
        return header, buf.to(self.device) if buf.device != self.device else buf

    def end(self, manifest: WeightManifest, ok: bool) -> None:
        self._close_handle()

    def close(self) -> None:
        self._close_handle()

    def _close_handle(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.close()


def abort_reason(handle: UpdateDir, manifest: WeightManifest) -> str:
    """The trainer's reason in the update's ``ABORT`` file, sanitised; never other file contents.
    An ABORT that is not a regular file (a symlink, a FIFO) raises WeightSyncError unread."""
    path = handle.path / ABORT
    try:
        fd = handle.open_regular(ABORT, "the abort marker")
    except OSError as exc:
        return f"(no reason read: {path} could not be opened: {exc.strerror})"
    try:
        data = os.read(fd, ABORT_MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        note = json.loads(data) if len(data) <= ABORT_MAX_BYTES else None
    except ValueError:
        note = None
    if not isinstance(note, dict) or not isinstance(note.get("reason"), str):
        return f"(no reason shown: {path} is not the trainer's abort note)"
    if note.get("update") != manifest.session_id:
        return f"(no reason shown: {path} is another update's abort note)"
    return sanitize_reason(note["reason"]) or "(no reason given)"


# ---- reading a bucket file --------------------------------------------------------------------------


def _check_entries(entries: dict[str, Any], placements: list[TensorPlacement], data_bytes: int) -> list[str]:
    """What differs between a file's tensor entries and the bucket's placements (empty: nothing)."""
    problems: list[str] = []
    want = {p.name: p for p in placements}
    extra = [n for n in entries if n not in want]
    if extra:
        problems.append(f"{len(extra)} tensor(s) not in this bucket, e.g. {', '.join(_show(n) for n in extra[:3])}")
    missing = [n for n in want if n not in entries]
    if missing:
        problems.append(f"missing {len(missing)} tensor(s), e.g. {', '.join(repr(n) for n in missing[:3])}")
    for name, p in want.items():
        entry = entries.get(name)
        if entry is None:
            continue
        if not isinstance(entry, dict):
            problems.append(f"'{name}': malformed entry")
            continue
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        expected_dtype = SAFETENSORS_DTYPES.get(p.dtype)
        if dtype != expected_dtype:
            problems.append(f"'{name}': dtype {_show(dtype)} in the file, {p.dtype} ({expected_dtype}) in the manifest")
        if not (isinstance(shape, list) and all(isinstance(d, int) for d in shape)):
            problems.append(f"'{name}': malformed shape in the file")
        elif tuple(shape) != tuple(p.shape):
            problems.append(f"'{name}': shape {shape} in the file, {list(p.shape)} in the manifest")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            problems.append(f"'{name}': malformed data offsets in the file")
        elif not (0 <= offsets[0] <= offsets[1] <= data_bytes) or offsets[1] - offsets[0] != p.nbytes:
            problems.append(f"'{name}': {offsets[1] - offsets[0]} bytes at {offsets} in the file "
                            f"({data_bytes} data bytes), {p.nbytes} bytes in the manifest")
    return problems


def _read_bucket(handle: UpdateDir, manifest: WeightManifest, index: int) -> tuple[BucketHeader, torch.Tensor]:
    path = handle.path / bucket_name(index)

    def refuse(what: str) -> WeightSyncError:
        return WeightSyncError(f"disk: {path} refused for update v{manifest.version}, bucket {index}: {what}",
                               peer=TRAINER, bucket=index)

    fd = handle.open_regular(bucket_name(index), f"bucket {index} file")
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise refuse("not a safetensors file (too short)")
        n = int.from_bytes(_pread_exact(fd, 8, 0), "little")
        if n < 2 or n > _MAX_HEADER_BYTES or 8 + n > size:
            raise refuse("not a safetensors file (bad header length)")
        try:
            entries = json.loads(_pread_exact(fd, n, 8))
        except ValueError:
            raise refuse("not a safetensors file (its header is not JSON)") from None
        if not isinstance(entries, dict):
            raise refuse("not a safetensors file (its header is not a JSON object)")
        meta = entries.pop("__metadata__", None)
        meta = meta if isinstance(meta, dict) else {}
        if meta.get("format") != FORMAT:
            raise refuse(f"not a bucket of this transport's format (format {_show(meta.get('format'))}, "
                         f"expected {FORMAT!r}); a stale or foreign file")
        stale = []
        if meta.get("update") != manifest.session_id:
            stale.append(f"update token {_show(meta.get('update'))}, expected {manifest.session_id!r}")
        if meta.get("version") != str(manifest.version):
            stale.append(f"version {_show(meta.get('version'))}, expected '{manifest.version}'")
        if meta.get("bucket") != str(index):
            stale.append(f"bucket {_show(meta.get('bucket'))}, expected '{index}'")
        if stale:
            raise refuse("it belongs to another update or bucket (stale or misplaced): " + "; ".join(stale))
        try:
            header = BucketHeader.model_validate_json(meta.get("header", ""))
        except ValidationError:
            raise refuse("its bucket header is malformed") from None
        expected_nbytes = manifest.buckets[index].nbytes
        if header.index != index or header.nbytes != expected_nbytes:
            raise refuse(f"its header says bucket {header.index} of {header.nbytes} bytes, "
                         f"the manifest bucket {index} of {expected_nbytes} bytes")
        placements = manifest.bucket_tensors(index)
        data_start = 8 + n
        problems = _check_entries(entries, placements, size - data_start)
        if problems:
            shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
            raise refuse(f"its tensors do not match the manifest: {shown}")
        buf = torch.zeros(header.nbytes, dtype=torch.uint8)
        raw = buf.numpy().data if header.nbytes else memoryview(bytearray())
        for p in placements:
            if p.nbytes:
                begin = entries[p.name]["data_offsets"][0]
                try:
                    _pread_into(fd, raw[p.offset : p.offset + p.nbytes], data_start + begin)
                except EOFError:
                    raise refuse(f"the file ended inside '{p.name}'") from None
    finally:
        os.close(fd)
    return header, buf


def read_bucket(directory: Path, manifest: WeightManifest, index: int) -> tuple[BucketHeader, torch.Tensor]:
    """Rebuild bucket ``index``'s flat buffer (zero padding) from its file in ``directory``, after
    checking that the file belongs to this update and matches the manifest (WeightSyncError if not)."""
    with UpdateDir(directory) as handle:
        return _read_bucket(handle, manifest, index)


# ---- crash recovery ----------------------------------------------------------------------------------


def _read_manifest(handle: UpdateDir) -> tuple[WeightManifest, int]:
    """The update's manifest and when it was written (ns); WeightSyncError if it is not a valid
    manifest of this very directory."""
    path = handle.path / MANIFEST
    fd = handle.open_regular(MANIFEST, "the manifest")
    try:
        st = os.fstat(fd)
        if st.st_size > _MAX_MANIFEST_BYTES:
            raise WeightSyncError(f"disk: {path} is too large ({st.st_size} bytes)")
        data = _pread_exact(fd, st.st_size, 0)
    except EOFError:
        raise WeightSyncError(f"disk: {path} changed while being read") from None
    finally:
        os.close(fd)
    try:
        manifest = WeightManifest.model_validate_json(data)
    except ValidationError as exc:
        raise WeightSyncError(f"disk: {path} is not a valid manifest ({exc.error_count()} error(s))") from None
    if update_dir(handle.path.parent, manifest).name != handle.path.name:
        raise WeightSyncError(f"disk: {path} describes another update (v{manifest.version}); a stale or moved manifest")
    return manifest, st.st_mtime_ns


def _load_update(handle: UpdateDir, manifest: WeightManifest) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for bucket in manifest.buckets:
        header, buf = _read_bucket(handle, manifest, bucket.index)
        if checksum(buf, manifest.checksum) != header.checksum:
            raise WeightSyncError(f"disk: checksum mismatch in {bucket_file(handle.path, bucket.index)}",
                                  bucket=bucket.index)
        tensors.update(bucket_views(buf, manifest.bucket_tensors(bucket.index)))
    return tensors


def is_full_update(manifest: WeightManifest) -> bool:
    """Whether ``manifest``'s update holds the whole model on its own (no delta on a base, no
    partial push, no LoRA adapter): what :func:`load_latest` can restart from."""
    delta = manifest.delta is not None and manifest.delta.base_version is not None
    return not (delta or manifest.partial or manifest.lora is not None)


def _holds_full_update(directory: Path) -> bool:
    """Whether ``directory``'s manifest describes a full update (False if it cannot be read)."""
    try:
        with UpdateDir(directory) as handle:
            return is_full_update(_read_manifest(handle)[0])
    except (WeightSyncError, OSError):
        return False


def load_latest(root: str | Path) -> tuple[WeightManifest, dict[str, torch.Tensor]] | None:
    """The newest complete, valid update in ``root`` (manifest and tensors by name), or None.

    Use it after a crash to restart an engine (or a trainer) from the last weights that were
    fully written, holding the whole model (see :func:`is_full_update`: delta, partial and LoRA
    pushes are skipped). Updates without ``manifest.json`` (interrupted) or with ``ABORT`` are skipped;
    so, with a logged warning, is a broken one (unparseable manifest, a missing, stale, reshaped or
    corrupt bucket, a checksum mismatch, a symlink), and the next newest is tried.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    candidates: list[tuple[int, int, Path, WeightManifest]] = []
    for d in root.iterdir():
        if not _UPDATE_NAME.fullmatch(d.name):
            continue
        try:
            with UpdateDir(d) as handle:
                if handle.exists(ABORT) or not handle.exists(MANIFEST):
                    continue  # aborted or interrupted: not a candidate, nothing to warn about
                manifest, written = _read_manifest(handle)
        except (WeightSyncError, OSError) as exc:
            logger.warning("disk: skipping update %s: %s", d, exc)
            continue
        if not is_full_update(manifest):
            continue  # a delta, partial or LoRA push is not the model's weights on its own
        candidates.append((manifest.version, written, d, manifest))
    for _, _, directory, manifest in sorted(candidates, key=lambda c: (c[0], c[1]), reverse=True):
        try:
            with UpdateDir(directory) as handle:
                return manifest, _load_update(handle, manifest)
        except (WeightSyncError, OSError) as exc:
            logger.warning("disk: skipping update %s (v%d): %s", directory, manifest.version, exc)
    return None
