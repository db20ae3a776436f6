"""The slot transports' signalling (what ``shm`` and ``cuda_ipc`` share) over a real TCPStore.

Buckets read where the trainer keeps them (zero-copy ``cuda_ipc``) exist only on a GPU. Here a
*fake* sharing sender stands in for that path on the CPU: it marks a bucket as shared instead of
packing it, and the fake receiver reads the trainer's tensors from a registry in this process.
Everything else is real: the protocol classes, the store, ``WeightSync``'s streaming,
``WeightReceiver``'s validation and apply, two receivers on their own threads.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import pytest
import torch
from rollout_engines.weights.manifest import TransportSpec, WeightManifest, plan_manifest, specs_of
from rollout_engines.weights.receiver import StateDictTarget, WeightReceiver
from rollout_engines.weights.session import WeightSync
from rollout_engines.weights.transports.shm import ShmReceiver, ShmSender

pytestmark = pytest.mark.timeout(120)

_SHARED: dict[str, torch.Tensor] = {}  # "shared memory" of the fake zero-copy path: this process


class FakeZeroCopySender(ShmSender):
    """Shares every bucket where its tensors lie; ``kept`` says whether the trainer keeps them
    (then receivers acknowledge once per push) or they are temporaries (once per bucket)."""

    def __init__(self, *, kept: bool, **kw: Any) -> None:
        super().__init__(**kw)
        self.kept = kept
        self.acked: list[int] = []

    def share_tensors(self, index: int, tensors: Any) -> Any:
        keys = []
        for i, t in enumerate(tensors):
            keys.append(f"{self.session_id}/{index}/{i}")
            _SHARED[keys[-1]] = t
        return {"keys": keys}

    def send_shared(self, header: Any, shared: Any, tensors: Any) -> None:
        self._publish(header, ack=not self.kept, direct=shared)

    def _acked(self, index: int) -> None:
        self.acked.append(index)


class FakeZeroCopyReceiver(ShmReceiver):
    def __init__(self, spec: TransportSpec, *, rank: int) -> None:
        super().__init__(spec, rank=rank)
        self.acks_sent = 0

    def _open_shared(self, info: dict[str, Any], index: int) -> list[torch.Tensor]:
        return [_SHARED[k] for k in info["direct"]["keys"]]

    def _before_ack(self) -> None:
        self.acks_sent += 1


def _module() -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])


def _push(sync: WeightSync, receivers: list[WeightReceiver], state: dict[str, torch.Tensor], version: int,
          bucket_bytes: int) -> WeightManifest:
    manifest = plan_manifest(specs_of(list(state.items())), version=version, bucket_bytes=bucket_bytes,
                             transport="shm", timeout_s=30)
    errors: list[BaseException] = []

    def receive(r: WeightReceiver) -> None:
        try:
            r.receive(manifest)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=receive, args=(r,)) for r in receivers]
    for t in threads:
        t.start()
    sync._stream(manifest, iter(state.items()))
    for t in threads:
        t.join(30)
    assert not errors, errors
    return manifest


@pytest.mark.parametrize("kept", [True, False])
def test_buckets_the_trainer_keeps_are_acknowledged_once_per_push(kept: bool) -> None:
    sender = FakeZeroCopySender(kept=kept, session_id=f"proto{int(kept)}", world_size=3, timeout_s=30, options={})
    spec = TransportSpec(transport="shm", session_id=sender.session_id, world_size=3, timeout_s=30,
                         options=sender.spec_options())
    modules = [_module(), _module()]
    receivers = []
    for rank, module in enumerate(modules, start=1):
        r = WeightReceiver(StateDictTarget(module), mode="inplace")
        r.transport = FakeZeroCopyReceiver(spec, rank=rank)
        r.transport.connect()
        receivers.append(r)
    sender.connect()
    sync = WeightSync([], sender, transport="shm", bucket_bytes=2048, timeout_s=30, checksum="sum64", progress=False)
    tokens: list[str] = []
    try:
        for version in (1, 2, 3):
            torch.manual_seed(version)
            state = {k: v.detach().clone() for k, v in _module().state_dict().items()}
            before = [r.transport.acks_sent for r in receivers]
            sender.acked.clear()
            manifest = _push(sync, receivers, state, version, bucket_bytes=2048)
            n = len(manifest.buckets)
            assert n >= 6
            for module in modules:  # every tensor landed in both receivers
                for name, t in module.state_dict().items():
                    assert torch.equal(t, state[name]), name
            sent = [r.transport.acks_sent - b for r, b in zip(receivers, before, strict=True)]
            # Kept tensors: one acknowledgement per receiver covers the push; temporaries: one per bucket.
            assert sent == ([1, 1] if kept else [n, n])
            # Temporaries: every bucket released, in order, once. Kept tensors: the sender waits
            # for no acknowledgement (the receive call's answer says the same).
            assert sender.acked == ([] if kept else list(range(n)))
            assert all(r.version == version for r in receivers)
            # The last update's log is deleted during this one (its end), this one's stays until the next.
            tokens.append(manifest.session_id)
            assert [bool(sender._kv.check([f"{t}/log"])) for t in tokens] == [False] * (len(tokens) - 1) + [True]
    finally:
        for r in receivers:
            r.close()
        sender.close()


def test_failures_count_for_the_update_they_were_reported_for() -> None:
    """A receiver's failure report names its update: the sender stops for it during that update and
    ignores it in later ones (no round trip to clear old reports before each push). A report
    without an update (from a receiver of an earlier release) always counts."""
    from rollout_engines.errors import WeightSyncError
    from rollout_engines.weights.transports import _store

    store, options = _store.host_store({}, 30.0)
    kv = _store.session_store(store, "f" * 16, options["secret"])
    watch = _store.PeerWatch(kv, [1, 2], dead_after_s=60)
    watch.token = "update-a"
    watch.check(0)
    _store.report_failure(kv, 2, "update v3 failed at bucket 4", token="update-a")
    with pytest.raises(WeightSyncError, match="receiver rank 2 gave up: update v3 failed at bucket 4"):
        watch.check(4)
    watch.token = "update-b"
    watch.check(0)  # the next update: the old report is not this one's
    assert watch.failures_seen == watch.failures() == 1
    assert kv.read("failed/2") is not None and kv.read("failed/1") is None
    _store.report_failure(kv, 1, "no token")
    with pytest.raises(WeightSyncError, match="receiver rank 1 gave up: no token"):
        watch.check(0)


def _pair(session: str, timeout_s: float = 30) -> tuple[ShmSender, WeightReceiver, torch.nn.Module, WeightSync]:
    sender = ShmSender(session_id=session, world_size=2, timeout_s=timeout_s, options={})
    spec = TransportSpec(transport="shm", session_id=session, world_size=2, timeout_s=timeout_s,
                         options=sender.spec_options())
    module = _module()
    receiver = WeightReceiver(StateDictTarget(module), mode="inplace")
    receiver.transport = ShmReceiver(spec, rank=1)
    receiver.transport.connect()
    sender.connect()
    sync = WeightSync([], sender, transport="shm", bucket_bytes=2048, timeout_s=timeout_s, checksum="sum64",
                      progress=False)
    return sender, receiver, module, sync


def _receive_into(receiver: WeightReceiver, manifest: WeightManifest, errors: list[BaseException]) -> None:
    try:
        receiver.receive(manifest)
    except BaseException as exc:  # the caller asserts on it
        errors.append(exc)


def test_a_receiver_waiting_seconds_for_the_first_bucket_logs_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    """A receiver that starts an update long before anything of it is published (a trainer that
    gathers its first bucket for seconds) waits quietly and then takes every bucket. A wait that
    blocked on the store would log two c10d warnings each time it timed out to check the sender
    (four lines a second here), from every worker of every engine."""
    sender, receiver, module, sync = _pair("ahead0")
    try:
        torch.manual_seed(1)
        state = {k: v.detach().clone() for k, v in _module().state_dict().items()}
        manifest = plan_manifest(specs_of(list(state.items())), version=1, bucket_bytes=2048,
                                 transport="shm", timeout_s=30)
        errors: list[BaseException] = []
        capfd.readouterr()
        thread = threading.Thread(target=_receive_into, args=(receiver, manifest, errors))
        thread.start()
        time.sleep(1.3)  # the receiver waits for bucket 0 all this time
        sync._stream(manifest, iter(state.items()))
        thread.join(30)
        assert not errors, errors
        assert all(torch.equal(t, state[n]) for n, t in module.state_dict().items())
        err = capfd.readouterr().err
        assert "waitForInput" not in err and "timed out after" not in err, err[:2000]
    finally:
        receiver.close()
        sender.close()


def test_an_abort_before_the_first_bucket_ends_a_waiting_receive_within_a_second() -> None:
    """A receive waiting for its first bucket looks at the sender's abort twice a second: an update
    the trainer gives up before publishing anything fails the receive then, not at the timeout."""
    from rollout_engines.errors import WeightSyncError

    sender, receiver, _, sync = _pair("ahead1", timeout_s=60)
    state = {k: v.detach().clone() for k, v in _module().state_dict().items()}
    manifest = plan_manifest(specs_of(list(state.items())), version=1, bucket_bytes=2048, transport="shm",
                             timeout_s=60)
    caught: list[BaseException] = []
    try:
        thread = threading.Thread(target=_receive_into, args=(receiver, manifest, caught))
        thread.start()
        time.sleep(0.2)
        sender.begin(manifest)
        sender.abort("the trainer gave up on this update")
        start = time.monotonic()
        thread.join(10)
        waited = time.monotonic() - start
        assert not thread.is_alive(), "the receive kept waiting after the abort"
        assert caught and isinstance(caught[0], WeightSyncError), caught
        assert "gave up" in str(caught[0]) and waited < 5, (waited, caught[0])
    finally:
        receiver.close()
        sender.close()


def _steady_push(sync: WeightSync, receiver: WeightReceiver, state: dict[str, torch.Tensor],
                 version: int) -> tuple[WeightManifest, list[BaseException]]:
    """Push ``state`` as ``WeightSync.push`` does: a layout like the last push's is reused."""
    manifest, items = sync._manifest(list(state.items()), None, version)
    errors: list[BaseException] = []
    thread = threading.Thread(target=_receive_into, args=(receiver, manifest, errors))
    thread.start()
    try:
        sync._stream(manifest, iter(items))
    finally:
        thread.join(30)
    return manifest, errors


def _seeded(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in _module().state_dict().items()}


def _segments_mapped(session: str) -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                for line in maps if f"/roe_{session}_" in line]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads this process's memory mappings (Linux)")
def test_steady_pushes_build_their_slot_views_once_and_let_them_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ends of a packed transport view each tensor in the slot it passes through. A push of the
    layout and through the slots of the push before reuses those views (building them again cost
    ~10 us a tensor, every push); a new layout, or new slots after an aborted push, builds them
    again; every push still lands every value; closing both ends unmaps every slot."""
    from rollout_engines.weights import buckets
    from rollout_engines.weights import receiver as receiver_module

    built: list[int] = []
    real = buckets.bucket_views

    def counting(buf: torch.Tensor, placements: Any) -> Any:
        placements = list(placements)
        built.append(len(placements))
        return real(buf, placements)

    monkeypatch.setattr(buckets, "bucket_views", counting)
    monkeypatch.setattr(receiver_module, "bucket_views", counting)
    sender, receiver, module, sync = _pair("views0")

    def push(state: dict[str, torch.Tensor], version: int) -> tuple[int, int]:
        """Views built by this push and its bucket count, after checking that it landed every value."""
        before = len(built)
        manifest, errors = _steady_push(sync, receiver, state, version)
        assert not errors, errors
        assert all(torch.equal(t, state[n]) for n, t in module.state_dict().items())
        assert receiver.version == version
        assert len(manifest.buckets) >= 6
        return len(built) - before, len(manifest.buckets)

    try:
        built_now, buckets_now = push(_seeded(1), 1)
        assert built_now == 2 * buckets_now  # each bucket's views, once on each side
        for version in (2, 3):
            assert push(_seeded(version), version)[0] == 0
        reordered = dict(reversed(list(_seeded(4).items())))  # a new layout: its own buckets
        built_now, buckets_now = push(reordered, 4)
        assert built_now == 2 * buckets_now
        assert push(dict(reversed(list(_seeded(5).items()))), 5)[0] == 0

        # An update the trainer gives up after a few tensors: the sender drops its slots, the
        # receiver its views; the next push goes through new slots and lands whole (where a new
        # slot is mapped at an old one's address, the views kept for that address are its views).
        state = dict(reversed(list(_seeded(6).items())))
        manifest, items = sync._manifest(list(state.items()), None, 6)

        def failing() -> Any:
            for i, item in enumerate(items):
                if i == 5:
                    raise RuntimeError("the trainer's gather failed")
                yield item

        errors: list[BaseException] = []
        thread = threading.Thread(target=_receive_into, args=(receiver, manifest, errors))
        thread.start()
        with pytest.raises(RuntimeError, match="gather failed"):
            sync._stream(manifest, failing())
        thread.join(30)
        assert errors, "the receive of the abandoned update succeeded"
        assert sender._slots == [None, None], "the aborted update's slots are still open"
        push(dict(reversed(list(_seeded(7).items()))), 7)
        assert push(dict(reversed(list(_seeded(8).items()))), 8)[0] == 0
        assert _segments_mapped("views0"), "the open slots are mapped while the session runs"
    finally:
        receiver.close()
        sender.close()
        asyncio.run(sync.close())
    assert _segments_mapped("views0") == []
