"""Failover of the in-process ExpertMesh on one local Ray: a restore by the controller under the wait policy, the
wait policy giving up, the degrade policy, a breaker ejecting a replica, and expert actors killed mid-generation.

Every outcome is checked against the in-process reference model (the fault-free one, or one that degrades around
the same lost expert), so "it kept serving" always means "it served the exact result".
"""

from __future__ import annotations

import time

import pytest
import ray
import torch

from expertmesh.cluster.controller_config import ControllerConfig
from expertmesh.cluster.naming import NAMESPACE
from expertmesh.experts.gating import Routing, degrade
from expertmesh.experts.reference import load_reference_model
from expertmesh.router_service.config import ExpertsConfig, ModelConfig
from expertmesh.router_service.dispatch import FailoverConfig, NoReplicaError
from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
from tests.tiny_checkpoints import VOCAB, greedy_tokens
from tests.traffic import controller_state, kill_and_wait, wait_for

TOL = 1e-4
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
MAX_TOKENS = 8


pytestmark = pytest.mark.usefixtures("local_ray")


@pytest.fixture(scope="module")
def expected(reference) -> list[int]:
    return greedy_tokens(reference, PROMPT, MAX_TOKENS)


def routing_of(model, ids: list[int] = PROMPT) -> dict[int, Routing]:
    """layer -> the routing of one forward of `ids` (to check a test's victim really is on the path)."""
    model.forward([torch.tensor(ids)])
    return dict(model.last_trace.routings)


def tokens_of(routing: Routing, expert: int) -> int:
    return int((routing.experts == expert).sum())


def make_mesh(checkpoints, replicas_per_expert: int = 1, restore: bool = False,
              failover: FailoverConfig | None = None) -> ExpertMesh:
    """restore: run the controller (which restores killed experts); otherwise no controller at all."""
    return ExpertMesh(MeshConfig(model=ModelConfig(path=str(checkpoints["mixtral"])),
                                 experts=ExpertsConfig(replicas_per_expert=replicas_per_expert, layout="per-expert"),
                                 failover=failover or FailoverConfig(), controller=ControllerConfig(enabled=restore)))


def calls_per_actor(mesh: ExpertMesh) -> dict[str, int]:
    return {info["name"]: info["calls"] for info in mesh.actor_info()}


class DegradedExperts:
    """The reference's LocalExperts, serving the routing the degrade policy makes with some experts unavailable."""

    def __init__(self, inner, available: torch.Tensor):
        self.inner = inner
        self.available = available

    def effective_routing(self, layer: int, routing: Routing) -> Routing:
        return degrade(routing, self.available)

    def run(self, layer: int, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        return self.inner.run(layer, hidden, degrade(routing, self.available))


class TestControllerRestores:
    """One pool of single replicas with the controller running, shared by the two tests of this class."""

    @pytest.fixture(scope="class")
    def mesh(self, checkpoints):
        # wait_timeout_s leaves room for a restore (a fresh process loading torch) on a loaded 2-core machine.
        with make_mesh(checkpoints, replicas_per_expert=1, restore=True,
                       failover=FailoverConfig(no_replica_policy="wait", wait_timeout_s=60)) as mesh:
            yield mesh

    def test_wait_policy_rides_out_a_restore_by_the_controller(self, mesh, reference, expected):
        victim = "expert-e0-r0"
        assert tokens_of(routing_of(reference)[0], 0) > 0  # the prompt needs expert 0, which has one replica
        assert mesh.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS).token_ids == expected
        kill_and_wait(victim)
        result = mesh.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS)  # waits for the restore
        assert result.token_ids == expected
        assert mesh.backend.retried_calls > 0 and mesh.backend.degraded_slots == 0
        assert not mesh.backend.dead  # the router swapped the restored actor in
        info = ray.get(ray.get_actor(victim, namespace=NAMESPACE).info.remote())
        assert info["generation"] == 1 and info["name"] == victim and info["calls"] > 0
        # The event is recorded just after the restored actor answered; give the controller a moment.
        state = wait_for_event(mesh, "restored", victim, 10)
        restored = [e for e in state["events"] if e["kind"] == "restored" and e["actor"] == victim]
        assert restored[0]["generation"] == 1
        assert state["actors"][victim]["generation"] == 1 and state["epoch"] == 1
        assert [e["kind"] for e in state["events"] if e["actor"] == victim] == ["lost", "restored"]
        # Its placement claim (cluster/placement_claims.py) ended: Ray's free table showed it, or it came up.
        claims = state["claims"]
        assert claims["live"] == 0, claims
        if state["actors"][victim]["slot"]["num_cpus"] > 0:
            assert set(claims["ended"]) <= {"reflected", "alive"} and sum(claims["ended"].values()) == 1, claims

    def test_controller_restarted_by_ray_resumes_restoring(self, mesh):
        victim = "expert-e1-r0"
        first = ray.get(mesh.controller.get_state.remote())["started_at"]
        ray.kill(mesh.controller, no_restart=False)  # as a crash of its process would: Ray restarts it

        def restarted() -> bool:
            try:
                return ray.get(mesh.controller.get_state.remote(), timeout=5)["started_at"] != first
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return False

        wait_for(restarted, 60, "Ray to restart the controller", every=0.2)
        kill_and_wait(victim)
        # A watching controller notices within a check interval (0.5 s) and a pass of pings (each ≤ 5 s); 30 s
        # leaves room for a loaded CI machine while still failing a controller that never watches.
        wait_for_event(mesh, "lost", victim, 30)
        state = wait_for_event(mesh, "restored", victim, 60)
        assert state["actors"][victim]["generation"] == 1


def wait_for_event(mesh: ExpertMesh, kind: str, actor: str, timeout: float) -> dict:
    """The controller's state once it holds a `kind` event for `actor`; fails after `timeout` seconds."""

    def holding() -> dict | None:
        state = controller_state(mesh)
        return state if any(e["kind"] == kind and e["actor"] == actor for e in state["events"]) else None

    return wait_for(holding, timeout, f"a {kind} event for {actor}", every=0.2,
                    detail=lambda: controller_state(mesh)["events"])


def test_wait_policy_gives_up_with_no_replica_error(checkpoints, reference):
    victim = "expert-e2-r0"
    assert tokens_of(routing_of(reference)[0], 2) > 0
    # A one-token request that needs no expert 2 in any layer.
    spared = next([t] for t in range(VOCAB) if all(tokens_of(r, 2) == 0 for r in routing_of(reference, [t]).values()))
    want = reference.forward([torch.tensor(spared)])[0]
    with make_mesh(checkpoints, replicas_per_expert=1,
                   failover=FailoverConfig(no_replica_policy="wait", wait_timeout_s=1.5)) as mesh:
        kill_and_wait(victim)
        started = time.monotonic()
        with pytest.raises(NoReplicaError, match=r"expert\(s\) \[2\]"):
            mesh.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS)
        elapsed = time.monotonic() - started
        assert 1.5 <= elapsed < 15, elapsed  # it waited its 1.5 s, then gave up: no hang
        assert mesh.backend.dead == {victim}
        assert (mesh.score(spared) - want).abs().max().item() <= TOL  # what does not need expert 2 is served


def test_degrade_policy_serves_the_next_best_expert(checkpoints, reference):
    lost = 3
    assert tokens_of(routing_of(reference)[1], lost) > 0
    with make_mesh(checkpoints, replicas_per_expert=1, failover=FailoverConfig(no_replica_policy="degrade")) as mesh:
        kill_and_wait(f"expert-e{lost}-r0")
        result = mesh.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS)
        assert mesh.backend.degraded_slots > 0
        assert all(counts[lost] == 0 for counts in result.tokens_per_expert.values())
        got = mesh.score(PROMPT)
        assert all(tokens_of(r, lost) == 0 for r in mesh.model.last_trace.routings.values())

    degraded = load_reference_model(checkpoints["mixtral"])
    available = torch.ones(degraded.cfg.num_experts, dtype=torch.bool)
    available[lost] = False
    degraded.experts = DegradedExperts(degraded.experts, available)
    want = degraded.forward([torch.tensor(PROMPT)])[0]
    assert (got - want).abs().max().item() <= TOL
    assert result.token_ids == greedy_tokens(degraded, PROMPT, MAX_TOKENS)
    # Losing the expert did change the logits, so the comparison above means something.
    assert (got - reference.forward([torch.tensor(PROMPT)])[0]).abs().max().item() > TOL


class TestTwoReplicas:
    """Two replicas per expert, one pool shared by the breaker test and then the kill test (which leaves replicas
    dead): starting eight actors costs more than the rest of either test."""

    @pytest.fixture(scope="class")
    def replicated(self, checkpoints):
        with make_mesh(checkpoints, replicas_per_expert=2) as mesh:
            yield mesh

    def test_open_breaker_skips_its_replica_and_results_stay_exact(self, replicated, reference):
        mesh, backend = replicated, replicated.backend
        ejected, peer = "expert-e3-r0", "expert-e3-r1"
        routed = routing_of(reference)
        want = reference.forward([torch.tensor(PROMPT)])[0]
        assert tokens_of(routed[0], 3) >= 2 and tokens_of(routed[1], 3) >= 2  # both replicas would get tokens
        assert tokens_of(routed[0], 2) >= 2 and tokens_of(routed[1], 2) == 0
        now = backend.clock()
        for _ in range(backend.breakers.cfg.consecutive_failures):
            backend.breakers.record(ejected, now, ok=False)
        assert backend.breakers.get(ejected).state == "open"
        try:
            before = calls_per_actor(mesh)
            got = mesh.score(PROMPT)
            after = calls_per_actor(mesh)
            assert after[ejected] == before[ejected]  # nothing sent to the ejected replica
            assert after[peer] - before[peer] == 2  # its peer took all of expert 3's tokens, one call per layer
            # Expert 2 (layer 0 only) still splits its tokens over both replicas.
            assert after["expert-e2-r0"] - before["expert-e2-r0"] == 1
            assert after["expert-e2-r1"] - before["expert-e2-r1"] == 1
            assert (got - want).abs().max().item() <= TOL
            assert backend.retried_calls == 0 and backend.degraded_slots == 0 and not backend.dead
            assert backend.breakers.get(ejected).state == "open"  # the ejection lasts (30 s), not one step
        finally:
            backend.breakers.states.pop(ejected, None)  # the next test on this mesh starts with closed breakers


    def test_replicas_killed_mid_generation_give_the_fault_free_output(self, replicated, reference,
                                                                       expected):
        mesh, backend = replicated, replicated.backend
        assert tokens_of(routing_of(reference)[1], 1) >= 2  # expert 1 takes prompt tokens at layer 1: both replicas
        victims = ("expert-e1-r0", "expert-e2-r1")
        clean = mesh.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS)
        assert clean.token_ids == expected
        assert backend.retried_calls == 0

        original_run = backend.run
        runs = {"n": 0}

        def run_with_kill(layer, hidden, routing):
            runs["n"] += 1
            if runs["n"] == 2:  # layer 1 of the prompt's forward: mid-step, after layer 0 used every replica
                for name in victims:
                    kill_and_wait(name)
            return original_run(layer, hidden, routing)

        backend.run = run_with_kill
        try:
            faulted = mesh.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS)
        finally:
            del backend.run
        assert runs["n"] == 2 * MAX_TOKENS  # two MoE layers per step: the kill happened inside this generation
        assert faulted.token_ids == expected == clean.token_ids
        assert faulted.tokens_per_expert == clean.tokens_per_expert  # no token moved to another expert
        assert backend.retried_calls > 0
        assert backend.dead == {"expert-e1-r0"}  # e2-r1 got no call after the kill: one-token steps use r0
        assert backend.degraded_slots == 0
        # Again with both victims gone for good (no controller here): prompt tokens of expert 2 now all go to r0.
        again = mesh.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS)
        assert again.token_ids == expected
        assert backend.dead == set(victims)
        for name in victims:
            with pytest.raises(ValueError):
                ray.get_actor(name, namespace=NAMESPACE)


def test_rays_actor_table_tells_a_restore_queued_for_room_from_one_given_a_worker():
    """What the controller's unplaced-restore watch reads (cluster/ray_ops.py named_actor_has_worker): Ray names a
    node for an actor queued there for want of room too, so only a worker says it got its share."""
    from expertmesh.cluster.ray_ops import named_actor_has_worker, named_actor_node

    @ray.remote
    class Holder:
        def ping(self) -> int:
            return 1

    # Every CPU of the shared Ray free first: the earlier tests' actors may still be going (CI: one freed its CPU
    # after this test read the free table, and the "queued" actor got it).
    cpus = ray.cluster_resources()["CPU"]
    wait_for(lambda: ray.available_resources().get("CPU", 0) >= cpus, timeout=60, what="every CPU free",
             detail=ray.available_resources)
    big = Holder.options(name="room-taker", namespace=NAMESPACE, num_cpus=cpus).remote()
    ray.get(big.ping.remote())
    queued = Holder.options(name="room-wanter", namespace=NAMESPACE, num_cpus=0.5).remote()
    try:
        wait_for(lambda: named_actor_node("room-wanter", NAMESPACE) is not None, timeout=10,
                 what="the queued actor in Ray's actor table")
        time.sleep(1.0)
        assert named_actor_has_worker("room-taker", NAMESPACE) is True
        assert named_actor_has_worker("room-wanter", NAMESPACE) is False  # queued: no share, no worker
        assert named_actor_has_worker("no-such-actor", NAMESPACE) is None
        ray.kill(big, no_restart=True)
        assert ray.get(queued.ping.remote(), timeout=30) == 1
        assert named_actor_has_worker("room-wanter", NAMESPACE) is True
    finally:
        for handle in (big, queued):
            ray.kill(handle, no_restart=True)
