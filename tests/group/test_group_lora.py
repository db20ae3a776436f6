"""A LoRA push that fails on some members of an EngineGroup: the group records the adapter only for
the members that applied it, routes requests naming it only to members at its current version, and
raises a typed error naming the failed members. Real transformers engines on the tiny model; one
member refuses with its own error (it holds a newer version of the adapter, pushed to it alone).
A rank above what some member serves is refused by the group itself: test_group_capabilities.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import rollout_engines as roe
import torch
from rollout_engines import InvalidRequest, ManifestMismatch, WeightSyncError
from rollout_engines.testing.conformance import make_lora
from rollout_engines.weights.checkpoint import load_checkpoint


def request(lora: str | None = None) -> roe.GenerateRequest:
    return roe.GenerateRequest(prompt_token_ids=[[11, 12, 13, 14]], lora=lora,
                               sampling=roe.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))


async def push(to: roe.EngineProtocol, spec: roe.LoraSpec, tensors: dict[str, torch.Tensor], version: int) -> int:
    async with await roe.connect_weight_sync([to], transport="inproc") as sync:
        return await sync.push_lora(spec, tensors, version=version)


async def test_a_partly_failed_lora_push_is_served_only_by_the_members_that_applied_it(tiny_model: Path) -> None:
    weights = load_checkpoint(str(tiny_model), torch.float32)
    members = [roe.create_engine("transformers", model=str(tiny_model), dtype="float32") for _ in range(2)]
    group = roe.EngineGroup(members, health_interval_s=None)
    late = roe.create_engine("transformers", model=str(tiny_model), dtype="float32")
    try:
        assert await group.add_engine(late) == 2
        members.append(late)
        base = (await group.generate(request()))[0].token_ids

        v1, v1_tensors = make_lora(weights, "a", rank=4, seed=1)
        assert await push(group, v1, v1_tensors, 1) == 1
        assert group.loras == {"a": 1} and all(m.loras == {"a": 1} for m in members)
        first = (await group.generate(request("a")))[0].token_ids
        assert first != base

        # Member 2 got v3 on its own; the group's v2: members 0 and 1 apply it, member 2 refuses it.
        v3, v3_tensors = make_lora(weights, "a", rank=4, seed=3)
        assert await push(late, v3, v3_tensors, 3) == 3
        v2, v2_tensors = make_lora(weights, "a", rank=8, seed=2)
        with pytest.raises(WeightSyncError) as failed:
            await push(group, v2, v2_tensors, 2)
        text = str(failed.value)
        assert not isinstance(failed.value, ManifestMismatch), "something was installed: not a refusal of the push"
        assert "members 2" in text and "versions must increase" in text and "members 0, 1 applied it" in text
        assert group.loras == {"a": 2}
        assert [m.loras for m in members] == [{"a": 2}, {"a": 2}, {"a": 3}]
        # the group's record: what each member applied of the group's pushes
        assert [s["loras"] for s in group.member_stats()] == [{"a": 2}, {"a": 2}, {"a": 1}]

        # Requests naming it get v2, from members 0 and 1 only; member 2 (at another version) gets none.
        before = [s["completed"] for s in group.member_stats()]
        outs = [o[0] for o in await asyncio.gather(*(group.generate(request("a")) for _ in range(9)))]
        after = [s["completed"] for s in group.member_stats()]
        assert {(o.lora, o.lora_version) for o in outs} == {("a", 2)}
        second = outs[0].token_ids
        assert all(o.token_ids == second for o in outs) and second not in (first, base)
        assert second != (await late.generate(request("a")))[0].token_ids  # member 2's v3
        assert after[2] == before[2] and after[0] > before[0] and after[1] > before[1]
        # The base model is still served by every member.
        for outs in await asyncio.gather(*(group.generate(request()) for _ in range(9))):
            assert outs[0].token_ids == base
        assert after[2] < [s["completed"] for s in group.member_stats()][2]

        # Refused by every member: the refusal's own type, and the group's record is unchanged.
        bad = v1.model_copy(update={"target_modules": ["not_a_layer"]})
        with pytest.raises(ManifestMismatch, match="not_a_layer"):
            await push(group, bad, v1_tensors, 4)
        assert group.loras == {"a": 2}

        # A later version every member takes brings member 2 back to requests naming it.
        v5, v5_tensors = make_lora(weights, "a", rank=4, seed=5)
        assert await push(group, v5, v5_tensors, 5) == 5
        assert [m.loras for m in members] == [{"a": 5}] * 3
        before = [s["completed"] for s in group.member_stats()]
        for outs in await asyncio.gather(*(group.generate(request("a")) for _ in range(9))):
            assert outs[0].lora_version == 5
        after = [s["completed"] for s in group.member_stats()]
        assert all(a > b for a, b in zip(after, before, strict=True))

        assert await group.unload_lora("a") is True
        assert group.loras == {} and all(m.loras == {} for m in members)
        assert all(s["loras"] == {} for s in group.member_stats())
        with pytest.raises(InvalidRequest, match="'a'"):
            await group.generate(request("a"))
    finally:
        await group.close()


async def test_a_member_that_alone_holds_another_version_gets_no_requests_for_it(tiny_model: Path) -> None:
    weights = load_checkpoint(str(tiny_model), torch.float32)
    first = roe.create_engine("transformers", model=str(tiny_model), dtype="float32")
    group = roe.EngineGroup([first], health_interval_s=None)
    other = roe.create_engine("transformers", model=str(tiny_model), dtype="float32")
    try:
        await group.add_engine(other)
        v1, v1_tensors = make_lora(weights, "solo", rank=4, seed=1)
        await push(group, v1, v1_tensors, 1)
        v3, v3_tensors = make_lora(weights, "solo", rank=4, seed=3)
        await push(other, v3, v3_tensors, 3)
        v2, v2_tensors = make_lora(weights, "solo", rank=8, seed=2)
        with pytest.raises(WeightSyncError, match="members 1"):
            await push(group, v2, v2_tensors, 2)
        # Member 0, the only holder of v2, goes away: requests naming the adapter are refused
        # rather than served at v3 by member 1.
        assert await first.unload_lora("solo") is True
        with pytest.raises(InvalidRequest, match="'solo' v2"):
            await group.generate(request("solo"))
        assert other.loras == {"solo": 3}
    finally:
        await group.close()
