"""An EngineGroup declares what every current member can do, also after members join or leave:
limits (LoRA rank, adapter slots, top logprobs) are the smallest, sets (pause modes, sleep levels,
transports) intersected, and a request beyond them is refused by the group itself. Real
transformers engines on the tiny model for the limits; EchoEngine members for sets and flags."""

from __future__ import annotations

from pathlib import Path

import pytest
import rollout_engines as roe
import torch
from echo_engine import EchoEngine
from rollout_engines import CapabilityError, ManifestMismatch
from rollout_engines.backends.transformers.engine import TransformersEngine
from rollout_engines.errors import UpdateRefused
from rollout_engines.testing.conformance import make_lora
from rollout_engines.weights.checkpoint import load_checkpoint


class FewTopLogprobs(TransformersEngine):
    """A transformers engine that declares (and so enforces) fewer top logprobs than the backend."""

    capabilities = TransformersEngine.capabilities.model_copy(update={"top_logprobs": 2})


def request(top_logprobs: int | None = None) -> roe.GenerateRequest:
    return roe.GenerateRequest(prompt_token_ids=[[11, 12, 13, 14]], sampling=roe.SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True, top_logprobs=top_logprobs))


async def push(group: roe.EngineGroup, spec: roe.LoraSpec, tensors: dict[str, torch.Tensor], version: int) -> int:
    async with await roe.connect_weight_sync([group], transport="inproc") as sync:
        return await sync.push_lora(spec, tensors, version=version)


async def test_a_weaker_member_lowers_the_groups_limits_until_it_leaves(tiny_model: Path) -> None:
    weights = load_checkpoint(str(tiny_model), torch.float32)
    big = roe.create_engine("transformers", model=str(tiny_model), dtype="float32", max_lora_rank=16, max_loras=4)
    group = roe.EngineGroup([big], health_interval_s=None)
    small = FewTopLogprobs(roe.EngineConfig(backend="transformers", model=str(tiny_model), dtype="float32",
                                            options={"max_lora_rank": 4, "max_loras": 1}))
    try:
        caps = group.capabilities
        assert (caps.lora, caps.max_loras, caps.top_logprobs) == (16, 4, 20)
        assert await group.add_engine(small) == 1
        caps = group.capabilities
        assert (caps.lora, caps.max_loras, caps.top_logprobs) == (4, 1, 2)
        assert group.member_stats()[1]["serving"]

        # top_logprobs above the new limit: refused by the group, before any member sees it.
        with pytest.raises(CapabilityError, match="backend 'group' returns at most 2 top logprobs"):
            await group.generate(request(top_logprobs=5))
        assert [s["completed"] for s in group.member_stats()] == [0, 0]
        outs = [(await group.generate(request(top_logprobs=2)))[0] for _ in range(4)]
        assert all(len(o.top_logprobs or []) == 3 and all(len(p) >= 2 for p in o.top_logprobs or []) for o in outs)

        # A LoRA rank above the new limit, a second adapter beyond the single slot: refused by the
        # group (nothing installed anywhere), though the first member alone would take both.
        wide, wide_tensors = make_lora(weights, "wide", rank=8, seed=1)
        with pytest.raises(ManifestMismatch, match="engine 'group' serves ranks up to 4") as refused:
            await push(group, wide, wide_tensors, 1)
        assert isinstance(refused.value.__cause__, UpdateRefused)
        assert group.loras == {} and big.loras == {} and small.loras == {}
        a, a_tensors = make_lora(weights, "a", rank=4, seed=2)
        assert await push(group, a, a_tensors, 1) == 1
        b, b_tensors = make_lora(weights, "b", rank=4, seed=3)
        with pytest.raises(ManifestMismatch, match=r"engine 'group' already holds 1 LoRA adapters \(max_loras=1\)") as refused:
            await push(group, b, b_tensors, 1)
        assert isinstance(refused.value.__cause__, UpdateRefused)
        assert group.loras == {"a": 1} and big.loras == {"a": 1} and small.loras == {"a": 1}

        # The weaker member leaves: the group advertises, and serves, the first member's limits again.
        assert await group.remove_engine(1) is small and len(group) == 1 and not small.closed
        caps = group.capabilities
        assert (caps.lora, caps.max_loras, caps.top_logprobs) == (16, 4, 20)
        out = (await group.generate(request(top_logprobs=5)))[0]
        assert all(len(p) >= 5 for p in out.top_logprobs or [[]])
        assert await push(group, wide, wide_tensors, 1) == 1
        assert await push(group, b, b_tensors, 1) == 1
        assert group.loras == {"a": 1, "wide": 1, "b": 1} == big.loras and small.loras == {"a": 1}
    finally:
        await group.close()
        await small.close()


def echo(name: str, **caps: object) -> EchoEngine:
    """An EchoEngine that declares ``caps`` on top of (or instead of) the EchoEngine's."""
    e = EchoEngine(name)
    e.capabilities = e.capabilities.model_copy(update=caps)
    return e


async def test_sets_narrow_and_widen_with_the_members() -> None:
    group = roe.EngineGroup([echo("full", pause_modes=("abort",)), echo("other", pause_modes=("abort",))],
                            health_interval_s=None)
    narrow = echo("narrow", sleep_levels=(), transports=("disk",))
    try:
        assert group.pause_modes() == ("wait", "abort") and group.capabilities.sleep_levels == (1,)
        await group.add_engine(narrow)
        assert group.pause_modes() == ("wait",)
        assert group.capabilities.sleep_levels == () and group.capabilities.transports == ("disk",)
        with pytest.raises(CapabilityError, match="mode 'abort'"):
            await group.pause("abort")
        with pytest.raises(CapabilityError, match="does not support sleep"):
            await group.sleep(1)
        with pytest.raises(CapabilityError, match="over 'inproc'"):
            await roe.connect_weight_sync([group], transport="inproc")

        # The narrow member was replaced by a full one: the sets are the full members' again.
        await group.replace_engine(2, echo("again", pause_modes=("abort",)))
        assert narrow.closed
        assert group.pause_modes() == ("wait", "abort") and group.capabilities.sleep_levels == (1,)
        assert group.capabilities.transports == ("inproc", "disk")
        await group.pause("abort")
        await group.resume()
    finally:
        await group.close()


async def test_a_member_lacking_a_declared_flag_cannot_join_and_removal_recomputes_flags() -> None:
    plain, chatless = EchoEngine("plain"), echo("chatless", chat=False)
    group = roe.EngineGroup([plain], health_interval_s=None)
    try:
        with pytest.raises(CapabilityError, match=r"lacks \['chat'\]"):
            await group.add_engine(chatless)
        with pytest.raises(CapabilityError, match=r"lacks \['chat'\]"):
            await group.replace_engine(0, chatless)
        assert group.engines == [plain] and group.capabilities.chat and not plain.closed

        # A group built with the chatless member does not declare chat; once it leaves, it does.
        await group.close()
        plain = EchoEngine("plain")
        group = roe.EngineGroup([chatless, plain], health_interval_s=None)
        assert not group.capabilities.chat
        # an engine in another process joining a local group: 'multi_process' is OR-ed, not required
        await group.add_engine(echo("remote", multi_process=True))
        assert group.capabilities.multi_process
        await group.add_engine(EchoEngine("local"))
        assert await group.remove_engine(0) is chatless
        assert group.capabilities.chat and [m["index"] for m in group.member_stats()] == [0, 1, 2]
        with pytest.raises(ValueError, match="no member 3"):
            await group.remove_engine(3)
        await group.remove_engine(1)  # the multi-process one
        assert not group.capabilities.multi_process
        await group.remove_engine(1)
        with pytest.raises(ValueError, match="last engine"):
            await group.remove_engine(0)
    finally:
        await group.close()
