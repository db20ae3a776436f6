"""Engines as Ray actors on a real two-node local Ray cluster (CPU): placement on both nodes, a
gloo weight push to every worker, colocation on one bundle, and an actor killed mid-flight.

One cluster and one group of two ``transformers`` engines are shared by the module (starting Ray
and loading models is the slow part)."""

from __future__ import annotations

import asyncio
import os

import pytest
import pytest_asyncio

ray = pytest.importorskip("ray")

from rollout_engines import EngineGroup, GenerateRequest, SamplingParams, connect_weight_sync  # noqa: E402
from rollout_engines.weights.checkpoint import load_checkpoint, perturbed  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.transformers]
in_module_loop = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def greedy(prompts: list[str]) -> GenerateRequest:
    return GenerateRequest(prompts=prompts, sampling=GREEDY)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "object_store_memory": 80 * 2**20, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, object_store_memory=80 * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(cluster, tiny_model):
    from rollout_engines.ray import acreate_ray_engines, engine_placement_group

    pg = engine_placement_group(2, cpus_per_worker=1, strategy="STRICT_SPREAD")  # one engine per node
    engines = await acreate_ray_engines(
        2, "transformers", model=str(tiny_model), placement_group=pg, num_cpus=1, max_restarts=2
    )
    yield engines
    await asyncio.gather(*(e.close() for e in engines))
    ray.util.remove_placement_group(pg)


def make_group(engines, **kw) -> EngineGroup:
    kw.setdefault("health_interval_s", 0.5)
    return EngineGroup(engines, **kw)


async def push(targets, weights, version: int) -> None:
    sync = await connect_weight_sync(targets, "gloo", timeout_s=60)
    try:
        await sync.push(weights, version=version)
    finally:
        await sync.close()


@in_module_loop
async def test_gloo_push_reaches_engines_on_both_nodes(engines, tiny_model):
    assert len({e.node_id for e in engines}) == 2  # placed on both nodes
    group = make_group(engines, routing="round_robin")
    prompts = ["def fibonacci(n):", "The quick brown fox", "Once upon a time"]
    before = [await e.generate(greedy(prompts)) for e in engines]
    assert [c.token_ids for c in before[0]] == [c.token_ids for c in before[1]]

    await push([group], perturbed(load_checkpoint(tiny_model), seed=5), version=1)

    after = [await e.generate(greedy(prompts)) for e in engines]
    for b, a in zip(before, after, strict=True):
        assert any(x.token_ids != y.token_ids for x, y in zip(b, a, strict=True))  # every engine changed
        assert {c.weight_version for c in a} == {1}
    assert [c.token_ids for c in after[0]] == [c.token_ids for c in after[1]]  # and to the same weights
    routed = [await group.generate(greedy(prompts)) for _ in range(4)]  # through the group, both engines
    assert all([c.token_ids for c in r] == [c.token_ids for c in after[0]] for r in routed)
    assert [s["completed"] for s in group.member_stats()] == [2, 2]
    assert await group.detach() == engines  # the engines stay up for the next test


@in_module_loop
async def test_killed_actor_loses_no_request_and_rejoins_with_the_latest_weights(engines, tiny_model):
    original = load_checkpoint(tiny_model)
    weights = {7: perturbed(original, seed=7), 8: perturbed(original, seed=8)}
    rejoined: list[int] = []

    async def on_rejoin(engine, version):  # the trainer's side: push its current weights to one engine
        rejoined.append(version)
        await push([engine], weights[version], version)

    group = make_group(engines, on_rejoin=on_rejoin)
    await push([group], weights[7], version=7)
    probe = greedy(["Reinforcement learning is", "class Engine:"])
    reference = [c.token_ids for c in await engines[1].generate(probe)]
    victim, pid = engines[0], engines[0].pid

    # 300 tokens each: the victim's ~100 rows run for a second or more, so the kill (through Ray's
    # control plane, slow on a loaded machine) lands while they are in flight (12 tokens ran ~0.1 s).
    n = 300
    requests = [
        GenerateRequest(prompt_token_ids=[[11 + i % 300, 7, 42]], sampling=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        for i in range(200)
    ]
    tasks = [asyncio.ensure_future(group.generate(r)) for r in requests]
    for _ in range(200):  # kill once the victim has requests in flight
        await asyncio.sleep(0.01)
        if group.member_stats()[0]["outstanding"] > 0:
            break
    ray.kill(victim.actor, no_restart=False)
    results = await asyncio.gather(*tasks)

    assert len(results) == 200
    for request, out in zip(requests, results, strict=True):  # each caller got its own prompt's answer
        assert len(out) == 1 and out[0].prompt_token_ids == request.prompt_token_ids[0]
        assert out[0].weight_version == 7 and len(out[0].token_ids) == n
    stats = group.member_stats()
    assert sum(s["completed"] for s in stats) == 200  # every result taken from exactly one engine
    assert group.retried > 0 and stats[0]["failures"] >= 1

    for _ in range(600):  # Ray restarts the actor (a new process loads torch and the model); v7 before traffic
        if group.member_stats()[0]["serving"]:
            break
        await asyncio.sleep(0.25)
    assert group.member_stats()[0]["serving"], group.member_stats()[0]
    assert rejoined and set(rejoined) == {7}  # brought to the latest version (a failed try is retried)
    info = await victim.info()
    assert info.weight_version == 7 and victim.pid != pid  # a new process, at the latest version
    assert [c.token_ids for c in await victim.generate(probe)] == reference

    # The old session lost a member; a new one reaches every engine again.
    await push([group], weights[8], version=8)
    outs = [[c.token_ids for c in await e.generate(probe)] for e in engines]
    assert outs[0] == outs[1] != reference
    await group.check_health()
    assert all(s["serving"] and s["weight_version"] == 8 for s in group.member_stats())
    await group.detach()


@in_module_loop
async def test_trainer_worker_and_engine_share_one_bundle(cluster, tiny_model):
    from rollout_engines.envs import RayBundle
    from rollout_engines.ray import acreate_ray_engines, colocated_options, engine_placement_group

    pg = engine_placement_group(1, cpus_per_worker=1)

    @ray.remote
    class TrainerWorker:
        def where(self) -> tuple[str, int]:
            return ray.get_runtime_context().get_node_id(), os.getpid()

    trainer = TrainerWorker.options(**colocated_options(pg, 0, 0.5)).remote()
    opts = colocated_options(pg, 0, 0.5)
    [engine] = await acreate_ray_engines(
        1, "transformers", model=str(tiny_model), num_cpus=opts["num_cpus"],
        actor_options={"scheduling_strategy": opts["scheduling_strategy"]},
        ray_bundle=RayBundle(bundle_indices=(0,), gpus_per_worker=0.5, executor="ray"),
    )
    try:
        node, trainer_pid = await trainer.where.remote()
        assert engine.node_id == node and engine.pid != trainer_pid  # same bundle, two processes
        # the device environment was set in one place (envs.setup_device_env) inside the actor
        assert engine.env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
        assert engine.env["CUDA_VISIBLE_DEVICES"] is None
        out = await engine.generate(greedy(["The quick brown fox"]))
        assert len(out[0].token_ids) == 8
    finally:
        await engine.close()
        ray.kill(trainer)
        ray.util.remove_placement_group(pg)


def test_demo_runs_on_a_group_of_ray_engines(cluster, tiny_model):
    from rollout_engines.demo_group import run_group_demo

    summary = run_group_demo("transformers", str(tiny_model), engines=2, use_ray=True, max_tokens=8)
    assert summary["engines"] == 2 and summary["ray"] and summary["transport"] == "gloo"
    assert summary["outputs_changed"] and summary["same_after_wake"] and summary["restored_outputs_equal"]
    assert summary["weight_version"] == 1 and summary["tokens_per_s"] > 0
    assert all(e["completed"] > 0 and e["weight_version"] == 2 for e in summary["per_engine"])
    assert ray.is_initialized()  # it used the running cluster and left it running
