"""``sglang_nccl``: the trainer broadcasts, SGLang's own scheduler processes receive.

SGLang receives NCCL weight updates itself (``init_weights_update_group`` /
``update_weights_from_distributed``): every TP rank of the engine joins a process group that
SGLang builds with ``init_custom_process_group`` (a ``tcp://`` rendezvous plus a group name), and
per call receives one broadcast. The core's ``nccl`` transport speaks another protocol (a header
broadcast before each bucket, aligned payloads, a store of its own), so SGLang gets this transport:

* **Layout.** Every SGLang engine counts as one receiver in the core's session (the rank
  offsets the session hands out assume that); its real size in the group is its TP size. At
  connect time each engine registers its TP size in the session's store under the offset it was
  given; the sender waits for all of them, lays the ranks out (trainer 0, then each engine's TP
  ranks in order) and publishes each engine's real offset and the real world size. Then every
  side joins the NCCL group.
* **Validation before data.** Before the first bucket of an update each engine validates the
  whole manifest against its checkpoint and posts its verdict; the sender waits for every verdict
  and broadcasts nothing if any engine refused (then it aborts, and every engine raises). So a
  bad manifest changes no weights anywhere.
* **One broadcast per bucket** (more where dtypes would misalign, see
  :func:`~.payloads.aligned_chunks`). SGLang 0.5.17 has ``load_format="flattened_bucket"`` for
  ``update_weights_from_distributed``: it allocates one flat buffer for the bucket's tensors (back
  to back, manifest order) and receives it with a single broadcast. The sender compacts the core's
  aligned bucket into that layout (:func:`~.payloads.compact_bucket`, a device copy) and
  broadcasts it; the engine calls ``update_weights_from_distributed`` once per bucket with that
  bucket's names, dtypes and shapes. (Per-tensor broadcasts, SGLang's default format, would cost
  one collective per tensor.)
* **No checksums.** SGLang loads what it receives; the core's bucket checksum cannot be checked
  on this path. Corruption on the wire is NCCL's to detect.
* **Abort.** Before each bucket an engine waits for the sender's go-ahead for that bucket or its
  abort, so an update the trainer gives up is refused cleanly between buckets. A trainer that
  dies *inside* a broadcast leaves SGLang's scheduler waiting until the group's timeout
  (``TransportSpec.timeout_s``); the weights are then partly applied and the engine refuses to
  generate until the next complete push.
"""

from __future__ import annotations

import datetime
import logging
import socket
from typing import Any, ClassVar

import torch
from rollout_engines.errors import WeightSyncError
from rollout_engines.weights.buckets import BucketHeader
from rollout_engines.weights.manifest import TransportSpec, WeightManifest
from rollout_engines.weights.transports import _store
from rollout_engines.weights.transports.base import TransportReceiver, TransportSender

from .payloads import aligned_chunks, compact_bucket

logger = logging.getLogger("rollout_engines.sglang")

TRANSPORT = "sglang_nccl"


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def layout(tp_sizes: dict[int, int]) -> tuple[dict[int, int], int]:
    """Real rank offsets of engines registered by session offset -> TP size, and the world size
    (trainer is rank 0; engines' ranks follow in the order of their session offsets)."""
    offsets, next_rank = {}, 1
    for session_offset in sorted(tp_sizes):
        offsets[session_offset] = next_rank
        next_rank += tp_sizes[session_offset]
    return offsets, next_rank


def publish_layout(kv: Any, engines: int, timeout_s: float) -> tuple[int, dict[int, int]]:
    """Trainer side: wait for every engine's TP size, publish each one's real offset; returns
    the world size and the TP sizes by session offset."""
    keys = [f"tp/{offset}" for offset in range(1, engines + 1)]
    try:
        kv.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        raise WeightSyncError(
            f"sglang_nccl: not every SGLang engine registered within {timeout_s:.0f} s ({exc}); "
            "every receiver of this transport must be an SglangEngine", peer="receivers",
        ) from exc
    tp_sizes = {o: int(kv.get(f"tp/{o}")) for o in range(1, engines + 1)}
    offsets, world = layout(tp_sizes)
    for o, real in offsets.items():
        kv.set(f"layout/{o}", f"{real},{world}")
    return world, tp_sizes


def collect_verdicts(kv: Any, manifest: WeightManifest, engines: int, timeout_s: float) -> None:
    """Trainer side: wait until every engine validated ``manifest``; raise if any refused it."""
    token = manifest.session_id
    keys = [f"verdict/{token}/{o}" for o in range(1, engines + 1)]
    try:
        kv.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        raise WeightSyncError(
            f"sglang_nccl: engines did not answer update v{manifest.version} within {timeout_s:.0f} s",
            peer="receivers",
        ) from exc
    for o in range(1, engines + 1):
        verdict = kv.get(f"verdict/{token}/{o}").decode()
        if verdict != "ok":
            raise WeightSyncError(f"sglang_nccl: engine at offset {o} refused update v{manifest.version}: {verdict}")


class SglangNcclSender(TransportSender):
    """Trainer half: hosts the rendezvous, lays out the ranks, broadcasts compacted buckets.

    Needs SGLang importable in the trainer process (for the group constructor SGLang's receivers
    use) and a CUDA device (``options['device']`` or the current one)."""

    name: ClassVar[str] = TRANSPORT

    def __init__(self, *, session_id: str, world_size: int, timeout_s: float, options: dict[str, Any]):
        super().__init__(session_id=session_id, world_size=world_size, timeout_s=timeout_s, options=options)
        if not torch.cuda.is_available():
            raise WeightSyncError("sglang_nccl needs a CUDA device in the trainer; use 'disk' without one")
        dev = self.options.get("device")
        self._device = torch.device(dev) if dev is not None else torch.device("cuda", torch.cuda.current_device())
        store, spec = _store.host_store(self.options, timeout_s)
        self._kv = _store.session_store(store, session_id, spec["secret"])  # the only hold on the store
        host = str(self.options.get("host", _store.DEFAULT_HOST))
        self._spec = {
            **spec,
            "group_name": f"roe-sglang-{session_id}",
            "group_port": int(self.options.get("group_port") or free_port(host)),
        }
        self._engines = world_size - 1
        self._pg: Any = None
        self._token = ""
        self._placements: dict[int, list[Any]] = {}
        self._slots: list[torch.Tensor] = []
        self._inflight: list[tuple[Any, torch.Tensor]] = []
        self._next_slot = 0

    def spec_options(self) -> dict[str, Any]:
        return dict(self._spec)

    def device(self) -> torch.device:
        return self._device

    def connect(self) -> None:
        world, tp_sizes = publish_layout(self._kv, self._engines, self.timeout_s)
        from sglang.srt.utils.common import init_custom_process_group

        torch.cuda.set_device(self._device)
        self._pg = init_custom_process_group(
            backend="nccl",
            init_method=f"tcp://{self._spec['host']}:{self._spec['group_port']}",
            world_size=world,
            rank=0,
            group_name=self._spec["group_name"],
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )
        logger.info("sglang_nccl: group of %d ranks (%s)", world, tp_sizes)

    def begin(self, manifest: WeightManifest) -> None:
        self._token = manifest.session_id
        self._placements = {b.index: manifest.bucket_tensors(b.index) for b in manifest.buckets}
        collect_verdicts(self._kv, manifest, self._engines, self.timeout_s)

    def send_bucket(self, header: BucketHeader, buf: torch.Tensor) -> None:
        # Go-ahead for this bucket: the engines call update_weights_from_distributed only now.
        self._kv.set(f"go/{self._token}/{header.index}", "1")
        for chunk in aligned_chunks(self._placements[header.index]):
            need = sum(p.nbytes for p in chunk)
            # The previous use of a slot (two broadcasts ago) must be on the wire before reuse.
            while len(self._inflight) > 1:
                self._wait_oldest(header.index)
            slot = self._next_slot
            self._next_slot ^= 1
            if len(self._slots) <= slot or self._slots[slot].numel() < need:
                self._slots[slot : slot + 1] = [torch.empty(need, dtype=torch.uint8, device=self._device)]
            packed = compact_bucket(buf[: header.nbytes], chunk, out=self._slots[slot])
            work = torch.distributed.broadcast(packed, src=0, group=self._pg, async_op=True)
            self._inflight.append((work, packed))
        # The core's contract: once this returns, the caller may overwrite ``buf``; the compacted
        # copies are ours, so only the copies out of ``buf`` have to be finished.
        torch.cuda.current_stream(self._device).synchronize()

    def _wait_oldest(self, index: int) -> None:
        work, _ = self._inflight.pop(0)
        if not work.wait(datetime.timedelta(seconds=self.timeout_s)):
            raise WeightSyncError("sglang_nccl: bucket not delivered in time", peer="receivers", bucket=index)

    def end(self, manifest: WeightManifest) -> None:
        while self._inflight:
            self._wait_oldest(len(manifest.buckets) - 1)
        for bucket in manifest.buckets:
            self._kv.delete_key(f"go/{self._token}/{bucket.index}")

    def abort(self, reason: str) -> None:
        self._kv.set(f"abort/{self._token}", reason[:1000] or "aborted")

    def close(self) -> None:
        self._inflight.clear()
        if self._pg is not None:
            try:
                torch.distributed.destroy_process_group(self._pg)
            except Exception:  # a group of a failed session may not shut down cleanly
                logger.debug("destroying the sglang_nccl group failed", exc_info=True)
            self._pg = None
        self._kv.close()  # nothing listens for a closed session


class SglangNcclControl:
    """Engine half of the control protocol (the data itself goes into SGLang's scheduler)."""

    def __init__(self, spec: TransportSpec) -> None:
        self.spec = spec
        self._kv = _store.session_store(
            _store.join_store(spec.options, spec.timeout_s), spec.session_id, _store.session_secret(spec.options)
        )
        self.group_name: str = spec.options["group_name"]
        self.host: str = spec.options["host"]
        self.group_port: int = int(spec.options["group_port"])

    def register(self, tp_size: int) -> tuple[int, int]:
        """Post this engine's TP size; returns its real rank offset and the world size."""
        me = self.spec.rank_offset
        self._kv.set(f"tp/{me}", str(tp_size))
        try:
            self._kv.wait([f"layout/{me}"], datetime.timedelta(seconds=self.spec.timeout_s))
        except Exception as exc:
            raise WeightSyncError("sglang_nccl: the trainer did not lay out the group in time", peer=_store.TRAINER) from exc
        real, world = (int(v) for v in self._kv.get(f"layout/{me}").decode().split(","))
        return real, world

    def verdict(self, manifest: WeightManifest, reason: str | None) -> None:
        self._kv.set(f"verdict/{manifest.session_id}/{self.spec.rank_offset}", reason or "ok")

    def wait_go(self, manifest: WeightManifest, index: int) -> None:
        """Block until the trainer broadcasts bucket ``index`` (or gave the update up)."""
        token = manifest.session_id
        go, abort = f"go/{token}/{index}", f"abort/{token}"

        def check() -> None:
            if self._kv.check([abort]):
                raise WeightSyncError(
                    f"sglang_nccl: the trainer aborted update v{manifest.version}: "
                    f"{self._kv.get(abort).decode()}", peer=_store.TRAINER, bucket=index,
                )

        _store.poll(
            lambda: self._kv.check([go]) and self._kv.get(go) == b"1", timeout_s=self.spec.timeout_s, check=check,
            on_timeout=lambda: WeightSyncError(
                f"sglang_nccl: bucket {index} of update v{manifest.version} did not come within "
                f"{self.spec.timeout_s:.0f} s", peer=_store.TRAINER, bucket=index,
            ),
        )


class SglangNcclReceiver(TransportReceiver):
    """Placeholder receiver: on ``sglang_nccl`` SGLang's scheduler receives, not a core receiver."""

    name: ClassVar[str] = TRANSPORT

    def __init__(self, spec: TransportSpec, *, rank: int, device: torch.device | str = "cpu"):
        raise WeightSyncError(
            "sglang_nccl is received by SGLang's own scheduler processes; only the 'sglang' backend can "
            "join it. Use 'nccl', 'gloo' or 'cuda_ipc' for other backends"
        )

    def recv_bucket(self, index: int, nbytes: int) -> tuple[BucketHeader, torch.Tensor]:  # pragma: no cover
        raise NotImplementedError
