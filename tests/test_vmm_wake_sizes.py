"""`benchmarks/vmm_wake.py`'s allocation plans (the GPU part needs CUDA; its sizes do not): the 14B
shape's allocations as vLLM's loader makes them, their merge into fewer, and the threads' shares."""

from __future__ import annotations

import sys

import pytest
from repo_scripts import load_script

vmm_wake = load_script("benchmarks/vmm_wake.py")


class _WeightsAndKv:
    """A fake driver (no GPU here) for the weights and a KV cache: it keeps what is mapped, checks
    that the weights are mapped before the KV cache and that a release gives back both, logs each
    call (and ``time.sleep``), and moves a fake clock one tick per ``perf_counter`` call (one more
    inside each KV mapping, so a timed span that held one would show it)."""

    def __init__(self, monkeypatch, release_s=0.0):
        self.state = {"weights": False, "kv": False, "events": []}
        self.release_s = release_s
        self.clock = iter(range(1000))
        monkeypatch.setattr(vmm_wake.time, "sleep", lambda s: self.state["events"].append(("sleep", s)))
        monkeypatch.setattr(vmm_wake.time, "perf_counter", lambda: float(next(self.clock)))

    def map_all(self, allocations, threads, drv):
        assert not self.state["weights"] and not self.state["kv"] and threads == 1
        self.state["weights"] = True
        self.state["events"].append("map")

    def map_kv(self):
        assert self.state["weights"] and not self.state["kv"]
        self.state["kv"] = True
        self.state["events"].append("map kv")
        next(self.clock)

    def release(self):
        assert self.state["weights"] and self.state["kv"]
        self.state["weights"] = self.state["kv"] = False
        self.state["events"].append("release both")
        return self.release_s


def test_the_14b_shape_has_its_weights_allocations_at_the_driver_granularity():
    sizes = vmm_wake.allocation_sizes("qwen3-14b")
    assert len(sizes) == 163  # 2 embeddings, 4 fused matrices a layer, the small tensors' 2 MiB blocks
    assert all(s % vmm_wake.GRANULARITY == 0 and s > 0 for s in sizes)
    assert 29.4e9 < sum(sizes) < 29.7e9  # the 14B shape's 29.5 GB in bf16, rounded up per allocation


@pytest.mark.parametrize("parts", [1, 2, 3, 8, 40])
def test_merged_keeps_every_byte_in_order_in_at_most_that_many_allocations(parts):
    sizes = vmm_wake.allocation_sizes("qwen3-14b")
    out = vmm_wake.merged(sizes, parts)
    assert sum(out) == sum(sizes)
    assert len(out) == parts if parts <= 8 else parts // 2 < len(out) <= parts
    # each merged allocation is a run of whole consecutive allocations
    edges, running = set(), 0
    for size in sizes:
        running += size
        edges.add(running)
    running = 0
    for size in out:
        running += size
        assert running in edges
    # about equal bytes: none more than one (largest) allocation above the mean
    assert max(out) <= sum(sizes) / parts + max(sizes)


@pytest.mark.parametrize("parts", [0, 163, 500])
def test_merged_leaves_the_allocations_as_they_are_when_no_merge_is_asked(parts):
    sizes = vmm_wake.allocation_sizes("qwen3-14b")
    assert vmm_wake.merged(sizes, parts) == sizes


def test_balanced_shares_hold_every_allocation_once():
    allocations = [(0, size, i, i) for i, size in enumerate(vmm_wake.allocation_sizes("qwen3-14b"))]
    shares = vmm_wake.balanced(allocations, 4)
    assert len(shares) == 4
    assert sorted(a for share in shares for a in share) == sorted(allocations)
    loads = [sum(a[1] for a in share) for share in shares]
    assert max(loads) - min(loads) <= max(a[1] for a in allocations)


def test_after_pause_maps_and_releases_in_a_refits_order(monkeypatch):
    """``--after-pause``'s rounds, over a fake driver that keeps the mapped state (no GPU here):
    every round starts and ends with the memory released, never maps mapped memory nor releases
    released memory, and times one mapping per round for each pause, first without a rest, then
    with one."""
    state = {"mapped": False, "events": []}
    monkeypatch.setattr(vmm_wake.time, "sleep", lambda s: state["events"].append(("sleep", s)))

    def map_all(allocations, threads, drv):
        assert not state["mapped"] and threads == 1
        state["mapped"] = True
        state["events"].append("map")

    def release():
        assert state["mapped"]
        state["mapped"] = False
        state["events"].append("release")
        return 0.0

    out = vmm_wake.after_pause([(0, 2 << 20, 0, 0)], None, 2, [0.0, 1.0], map_all, lambda: None, release)
    assert list(out) == ["right_after_release_then_0.0s_mapped", "right_after_release_then_1.0s_mapped",
                         "rested_then_0.0s_mapped", "rested_then_1.0s_mapped"]
    assert all(len(times) == 2 and all(t >= 0 for t in times) for times in out.values())
    assert state["mapped"] is False
    # a rested round: map, release, rest 0.5 s, map, stay mapped P s, release, map (timed), release
    assert state["events"][-8:] == ["map", "release", ("sleep", 0.5), "map", ("sleep", 1.0), "release", "map",
                                    "release"]
    assert ("sleep", 0.5) not in state["events"][: len(state["events"]) // 2]  # no rest in the first half


def test_kv_sizes_give_one_allocation_per_layer_holding_at_least_the_bytes_asked():
    sizes = vmm_wake.kv_sizes("qwen3-14b", 4 << 30)
    assert len(sizes) == vmm_wake.SHAPES["qwen3-14b"][2]
    assert all(s % vmm_wake.GRANULARITY == 0 and s == sizes[0] for s in sizes)
    assert 4 << 30 <= sum(sizes) < (4 << 30) + len(sizes) * vmm_wake.GRANULARITY


def test_after_pause_with_kv_maps_it_after_the_weights_untimed_and_releases_both(monkeypatch):
    """``--kv-mb``: every mapping of the weights is followed by the KV cache's, outside the timed
    call, and every release gives back both (`_WeightsAndKv`, a fake driver)."""
    fake = _WeightsAndKv(monkeypatch)
    state, map_all, map_kv, release = fake.state, fake.map_all, fake.map_kv, fake.release

    out = vmm_wake.after_pause([(0, 2 << 20, 0, 0)], None, 1, [0.0], map_all, lambda: None, release, map_kv)
    assert not state["weights"] and not state["kv"]
    assert state["events"].count("map") == state["events"].count("map kv") == 6  # 3 per round, 2 rounds
    events = state["events"]
    assert all(events[i + 1] == "map kv" for i, ev in enumerate(events) if ev == "map")
    assert all(times == [1e3] for times in out.values())  # one clock tick: the weights' mapping alone


@pytest.mark.parametrize("argv, says", [
    (["--kv-mb", "4096"], "--kv-mb takes a size in MiB >= 0, and only with --after-pause"),
    (["--after-pause", "0", "--kv-mb", "-1"], "--kv-mb takes a size in MiB >= 0, and only with --after-pause"),
    (["--free-gb", "1"], "--free-gb takes a size in GB >= 0, and only with --after-pause"),
    (["--after-pause", "0", "--free-gb", "-0.5"], "--free-gb takes a size in GB >= 0, and only with --after-pause"),
])
def test_kv_mb_and_free_gb_are_refused_without_after_pause_or_below_zero(monkeypatch, capsys, argv, says):
    monkeypatch.setattr(sys, "argv", ["vmm_wake.py", *argv])
    with pytest.raises(SystemExit) as exc:
        vmm_wake.main()
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_filler_leaves_what_the_rounds_map_and_the_margin_free():
    assert vmm_wake.filler_bytes(free=80 << 30, need=30 << 30, keep=1 << 30) == 49 << 30
    assert vmm_wake.filler_bytes(free=30 << 30, need=30 << 30, keep=1 << 30) == 0  # never negative


def test_delay_rounds_wait_then_time_the_weights_mapping_alone_and_release_both(monkeypatch):
    """``--delays`` rounds (and, with ``--free-gb``, the same on the full device), over a fake driver:
    each round starts with the memory released, waits its delay, maps (timed: the weights alone; the
    KV cache's mapping follows outside the timed span) and releases both."""
    fake = _WeightsAndKv(monkeypatch, release_s=0.25)
    state, map_all, map_kv, release = fake.state, fake.map_all, fake.map_kv, fake.release

    releases = []
    out = vmm_wake.delay_rounds([(0, 2 << 20, 0, 0)], None, 2, [0.0, 0.5], map_all, lambda: None, release,
                                map_kv, releases=releases)
    assert out == {"0.0": [1e3, 1e3], "0.5": [1e3, 1e3]}  # one clock tick each: the weights' mapping
    assert releases == [0.25] * 4
    assert not state["weights"] and not state["kv"]
    assert state["events"][-4:] == [("sleep", 0.5), "map", "map kv", "release both"]
    assert [e for e in state["events"] if isinstance(e, tuple)] == [("sleep", 0.0)] * 2 + [("sleep", 0.5)] * 2


def test_delay_rounds_run_the_trainers_step_in_the_released_memory_before_each_wait(monkeypatch):
    """``--free-gb``'s trainer rounds: each starts with the engine's memory released, runs the
    trainer's step, then waits, maps (timed) and releases (`_WeightsAndKv`, a fake driver)."""
    fake = _WeightsAndKv(monkeypatch)
    state = fake.state

    def trainer():
        assert not state["weights"] and not state["kv"]  # the trainer runs only in memory the engine released
        state["events"].append("trainer")

    out = vmm_wake.delay_rounds([(0, 2 << 20, 0, 0)], None, 2, [0.5], fake.map_all, lambda: None, fake.release,
                                fake.map_kv, before=trainer)
    assert len(out["0.5"]) == 2
    assert state["events"] == ["trainer", ("sleep", 0.5), "map", "map kv", "release both"] * 2
