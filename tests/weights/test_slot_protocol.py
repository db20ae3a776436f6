"""The slot transports' signalling (what ``shm`` and ``cuda_ipc`` share) over a real TCPStore.

Buckets read where the trainer keeps them (zero-copy ``cuda_ipc``) exist only on a GPU. Here a
*fake* sharing sender stands in for that path on the CPU: it marks a bucket as shared instead of
packing it, and the fake receiver reads the trainer's tensors from a registry in this process.
Everything else is real: the protocol classes, the store, ``WeightSync``'s streaming,
``WeightReceiver``'s validation and apply, two receivers on their own threads.
"""

from __future__ import annotations

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
