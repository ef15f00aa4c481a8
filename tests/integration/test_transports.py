"""Every expert transport (Ray refs, gRPC, socket, compiled graph, Ray Direct Transport) against the in-process
reference, on one local Ray and one pool of expert actors (two replicas per expert, controller restoring): identical
logits, failover when an actor is killed under a running compiled graph, gRPC and socket reconnects after a restore,
servers that want the cluster secret, the rdt transport failing over under traffic and reading from a restored
replica, and a teardown that leaves nothing."""

from __future__ import annotations

import time
from multiprocessing import AuthenticationError

import grpc
import pytest
import ray
import torch

from expertmesh.cluster.naming import NAMESPACE
from expertmesh.experts import wire
from expertmesh.experts.arrays import pack, to_tensor
from expertmesh.experts.grpc_server import call_metadata
from expertmesh.experts.transport_secret import transport_secret
from expertmesh.protos import expert_transport_pb2_grpc as pb_grpc
from expertmesh.router_service.expert_pool import connect_actors
from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
from expertmesh.router_service.router import Router
from expertmesh.router_service.transports.compiled import CompiledGraphTransport
from expertmesh.router_service.transports.grpc import GrpcTransport
from expertmesh.router_service.transports.rdt import RdtTransport
from expertmesh.router_service.transports.socket import SocketTransport, split_address
from tests.socket_peer import dial
from tests.tiny_checkpoints import VOCAB, greedy_tokens
from tests.traffic import NonStopClient, kill_and_wait, wait_for

TOL = 1e-4
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
MAX_TOKENS = 6
OTHER_TRANSPORTS = ("grpc", "socket", "rdt", "compiled")  # besides refs; compiled last: its graph idles out after 30 s


pytestmark = pytest.mark.usefixtures("local_ray")


@pytest.fixture(scope="module")
def expected(reference) -> list[int]:
    return greedy_tokens(reference, PROMPT, MAX_TOKENS)


@pytest.fixture(scope="module")
def mesh(checkpoints):
    experts = {"replicas_per_expert": 2, "layout": "per-expert"}
    config = {"model": {"path": str(checkpoints["mixtral"])}, "experts": experts, "router": {"transport": "refs"}}
    with ExpertMesh(MeshConfig.from_dict(config)) as mesh:
        names = list(mesh.pool.spec.actor_shards)
        yield mesh

    def no_expert_alive() -> bool:
        for name in names:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
                return False
            except ValueError:
                continue
        return True

    wait_for(no_expert_alive, 30, "every expert actor to stop", every=0.2)


@pytest.fixture(scope="module")
def routers(mesh):
    """A router per transport over the same actors (the refs one is the mesh's own)."""
    out = {"refs": mesh.router}
    for name in OTHER_TRANSPORTS:
        out[name] = Router(mesh.pool.spec, mesh.actors, mesh.config.replace(**{"router.transport": name}))
    yield out
    for name in OTHER_TRANSPORTS:
        out[name].close()


def sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (17, 5, 1)]


def test_every_transport_gives_the_reference_logits(routers, reference):
    seqs = sequences()
    want = reference.forward([torch.tensor(s) for s in seqs])
    got = {name: router.score_batch(seqs) for name, router in routers.items()}
    for name, logits in got.items():
        for w, g in zip(want, logits):
            assert (g - w).abs().max().item() <= TOL, name
        # Same actors, same bytes, same combine order: the transports agree bit for bit.
        assert all(torch.equal(a, b) for a, b in zip(logits, got["refs"])), name
    compiled = routers["compiled"].transport
    assert isinstance(compiled, CompiledGraphTransport) and compiled.compiled_rounds > 0
    assert compiled.fallback_rounds == 0  # built before the first step: every round went through the graph
    assert isinstance(routers["grpc"].transport, GrpcTransport)
    assert isinstance(routers["socket"].transport, SocketTransport)
    assert isinstance(routers["rdt"].transport, RdtTransport)


def _nixl_registrations(_actor=None) -> tuple[dict, int]:
    """This process's rdt_box counters and its NIXL metadata version (bumped by every deregistration, after which
    each peer drops its connection and reloads the metadata: Ray 2.60 nixl_tensor_transport.py)."""
    from ray.experimental.rdt.util import get_tensor_transport_manager

    from expertmesh.experts import rdt_box

    return dict(rdt_box.stats), get_tensor_transport_manager("NIXL")._nixl_agent_meta_version


def test_rdt_puts_and_reads_memory_registered_once(routers):
    """Rounds on the rdt transport register no memory per call, in the router or in any actor: rows go out of the
    router's send slab, outputs out of each actor's NIXL pool, reads land in read slabs (experts/rdt_box.py). So no
    NIXL metadata changes and no peer reconnects between calls."""
    router = routers["rdt"]
    router.score_batch(sequences())
    router.generate(token_ids=PROMPT, max_tokens=2)
    counters, version = _nixl_registrations()
    assert counters == {"slab_misses": 0, "pool_misses": 0, "retired_reads": 0} and version == 0
    handles = router.transport.actors
    for name, (counters, version) in zip(handles, ray.get([h.__ray_call__.remote(_nixl_registrations)
                                                           for h in handles.values()], timeout=60)):
        assert counters == {"slab_misses": 0, "pool_misses": 0, "retired_reads": 0} and version == 0, name


def test_rdt_rows_and_outputs_too_big_for_the_slabs_take_the_per_call_way(routers, monkeypatch):
    """The router's send and read slabs full (here: 64 bytes): the rows are registered for their own put and the
    output read into a fresh buffer, and the call gives the same output as through the slabs."""
    from expertmesh.experts import rdt_box

    transport: RdtTransport = routers["rdt"].transport
    name = "expert-e0-r0"
    rows = pack(torch.randn(5, transport_hidden(routers), generator=torch.Generator().manual_seed(3)))
    (want,) = transport.gather_settled([transport.submit(name, 0, [0], [5], rows)], timeout=60)
    tiny = {role: rdt_box.RegisteredSlab(64, torch.device("cpu")) for role in ("send", "read")}
    monkeypatch.setattr(rdt_box, "slab", lambda role, device: tiny[role])
    before = dict(rdt_box.stats)
    (got,) = transport.gather_settled([transport.submit(name, 0, [0], [5], rows)], timeout=60)
    assert torch.equal(got, want)
    assert rdt_box.stats["slab_misses"] == before["slab_misses"] + 2  # the rows' put and the output's read
    assert all(s.ranges.taken == 0 for s in tiny.values())


def test_expert_grpc_servers_listen_on_the_node_ip_and_want_the_cluster_secret(routers):
    """Issue 18 item 13: each actor's gRPC server listens on its node's cluster IP, not every interface, and a
    caller without the cluster secret (kept in Ray's GCS) is refused with UNAUTHENTICATED. The router's transport
    sends it (the logits test above went through it)."""
    transport: GrpcTransport = routers["grpc"].transport
    assert transport.metadata == call_metadata(transport_secret())
    assert transport.connections and set(transport.connections) == set(transport.actors)
    node_ip = ray.util.get_node_ip_address()
    for conn in transport.connections.values():
        assert conn.address.rsplit(":", 1)[0].strip("[]") == node_ip
        with grpc.insecure_channel(conn.address) as channel:
            stub = pb_grpc.ExpertTransportStub(channel)
            for metadata in (None, call_metadata("not-the-secret")):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Forward(wire.encode_batch(0, [0], [1], pack(torch.zeros(1, 4))), metadata=metadata,
                                 timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, conn.address


def test_expert_socket_servers_listen_on_the_node_ip_and_want_the_cluster_secret(routers):
    """The socket transport's servers, likewise: on the node's cluster IP, and a peer that cannot answer the
    challenge with the cluster secret is dropped before a request is read (the router's transport holds it)."""
    transport: SocketTransport = routers["socket"].transport
    assert transport.secret == transport_secret().encode()
    assert transport.connections and set(transport.connections) == set(transport.actors)
    node_ip = ray.util.get_node_ip_address()
    for conn in transport.connections.values():
        assert split_address(conn.address)[0] == node_ip
        with pytest.raises(AuthenticationError):
            dial(conn.address, b"not-the-secret")
        with dial(conn.address, transport.secret) as peer:  # the secret is all it takes
            reply = peer.forward(wire.encode_batch(0, [0], [1], pack(torch.zeros(1, 4))))
            assert reply.error  # a wrong hidden size, answered as an error, not a dropped connection

def test_generation_is_identical_on_every_transport(routers, expected):
    for name, router in routers.items():
        assert router.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS).token_ids == expected, name


def test_overlap_gives_the_reference_logits_and_generations(mesh, reference):
    """Two micro-batches per step whose expert rounds overlap the other's dense part (README: Overlap): the
    reference's logits, and a batched greedy decode (KV caches, sequences of different lengths) token for token."""
    seqs = sequences()
    want = reference.forward([torch.tensor(s) for s in seqs])
    for name in ("refs", "grpc", "socket"):
        config = mesh.config.replace(**{"router.transport": name, "router.overlap": True})
        router = Router(mesh.pool.spec, mesh.actors, config)
        try:
            for w, g in zip(want, router.score_batch(seqs)):
                assert (g - w).abs().max().item() <= TOL, name
            routed = router.model.last_trace.routings
            assert all(r.num_tokens == sum(map(len, seqs)) for r in routed.values())  # one Routing per layer
            prompts = [PROMPT, PROMPT[:4], seqs[0]]
            caches = [router.model.new_cache() for _ in prompts]
            steps, got = [torch.tensor(p) for p in prompts], [[] for _ in prompts]
            for _ in range(MAX_TOKENS):
                logits = router.model.forward(steps, caches)
                nxt = [int(x[-1].argmax()) for x in logits]
                for out, t in zip(got, nxt):
                    out.append(t)
                steps = [torch.tensor([t]) for t in nxt]
            assert got == [greedy_tokens(reference, p, MAX_TOKENS) for p in prompts], name
        finally:
            router.close()


def test_overlap_auto_resolves_off_on_a_cpu_router_and_serves_the_reference(mesh, reference):
    """router.overlap "auto" (the latency model's per-step choice, cluster/overlap_policy.py): on a CPU router it
    never splits a step (router and actors share the cores), and the logits are the reference's."""
    seqs = sequences()
    want = reference.forward([torch.tensor(s) for s in seqs])
    router = Router(mesh.pool.spec, mesh.actors, mesh.config.replace(**{"router.transport": "socket",
                                                                         "router.overlap": "auto"}))
    try:
        assert callable(router.model.overlap)  # a policy, asked per step
        assert not router.model._can_overlap([len(s) for s in seqs], [0] * len(seqs))
        for w, g in zip(want, router.score_batch(seqs)):
            assert (g - w).abs().max().item() <= TOL
    finally:
        router.close()


def test_killing_an_actor_under_the_compiled_graph_fails_over_then_rebuilds(routers, expected):
    router = routers["compiled"]
    transport: CompiledGraphTransport = router.transport
    assert transport.graph is not None
    victim = "expert-e0-r0"
    old_key = transport.graph.key
    builds, fallbacks = transport.builds, transport.fallback_rounds
    kill_and_wait(victim)  # its execution loop dies with it; the graph's next round fails
    assert router.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS).token_ids == expected
    assert transport.fallback_rounds > fallbacks and transport.torn_down >= 1
    assert router.backend.retried_calls > 0
    # The controller restores the victim under its name; the reviver swaps it in and the graph is rebuilt on
    # the new incarnation.
    def rebuilt() -> bool:
        assert router.generate(token_ids=PROMPT, max_tokens=2).token_ids == expected[:2]
        graph = transport.graph
        return graph is not None and graph.key != old_key and not router.backend.dead

    wait_for(rebuilt, 90, "a compiled graph on the restored actor", every=0.2)
    assert transport.builds > builds
    rounds = transport.compiled_rounds
    assert router.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS).token_ids == expected
    assert transport.compiled_rounds > rounds


def test_grpc_and_socket_transports_reconnect_after_a_restore(routers, expected):
    # One victim per transport, killed together so their restores overlap (each is an actor process importing torch:
    # the two waits one after another were ~40 s each on CI).
    victims = {"grpc": "expert-e1-r0", "socket": "expert-e2-r0"}
    old = {}
    for name, victim in victims.items():
        assert routers[name].generate(token_ids=PROMPT, max_tokens=MAX_TOKENS).token_ids == expected
        old[name] = routers[name].transport.connections[victim]
    for victim in victims.values():
        kill_and_wait(victim)
    for name, victim in victims.items():
        router = routers[name]
        assert router.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS).token_ids == expected
        assert victim in router.backend.dead  # a refused/reset connection was reported as Ray's actor death

    for name, victim in victims.items():
        router, transport = routers[name], routers[name].transport
        wait_for(lambda r=router, v=victim, o=old[name]: _reconnected(r, v, o.actor_id, expected), 90,
                 f"the {name} transport to dial the restored actor", every=0.2)
        new = transport.connections[victim]
        assert new.actor_id == ray.get_actor(victim, namespace=NAMESPACE)._actor_id
        calls = ray.get(ray.get_actor(victim, namespace=NAMESPACE).info.remote())["calls"]
        assert router.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS).token_ids == expected
        assert ray.get(ray.get_actor(victim, namespace=NAMESPACE).info.remote())["calls"] >= calls


def _reconnected(router, victim: str, old_actor_id, expected: list[int]) -> bool:
    assert router.generate(token_ids=PROMPT, max_tokens=2).token_ids == expected[:2]
    conn = router.transport.connections.get(victim)
    return not router.backend.dead and conn is not None and conn.actor_id != old_actor_id


def test_rdt_fails_over_under_traffic_and_reads_from_the_restored_replica(routers, expected):
    """An expert replica killed while requests run back to back on the rdt transport: every request still gets the
    reference tokens (the victim's calls fail within the step and go to its other replica), none hangs, and once
    the controller restores it the reviver swaps it in and the next calls read its outputs through NIXL."""
    router = routers["rdt"]
    victim = "expert-e3-r0"
    send = lambda ids: router.generate(token_ids=ids, max_tokens=MAX_TOKENS).token_ids  # noqa: E731
    with NonStopClient(send, [PROMPT]) as client:
        client.wait_for_results(1, timeout=120)
        old = ray.get_actor(victim, namespace=NAMESPACE)._actor_id
        kill_and_wait(victim)
        client.wait_for_results(2, timeout=120)
    assert not client.errors and client.results and all(r == expected for r in client.results)
    assert router.backend.retried_calls > 0

    def restored() -> bool:
        assert router.generate(token_ids=PROMPT, max_tokens=2).token_ids == expected[:2]
        handle = router.transport.actors[victim]
        return not router.backend.dead and handle._actor_id != old

    wait_for(restored, 120, "the rdt transport to call the restored actor", every=0.2,
             detail=lambda: f"dead: {router.backend.dead}, failed reads: {router.transport.failed_reads}")
    handle = ray.get_actor(victim, namespace=NAMESPACE)
    calls = ray.get(handle.info.remote())["calls"]
    assert router.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS).token_ids == expected
    assert ray.get(handle.info.remote())["calls"] > calls


def test_rdt_output_of_an_actor_that_died_after_computing_fails_as_its_death(routers):
    """The call finished, its output waits in the actor's memory, then the actor dies before the router reads it:
    the read fails at once (NIXL aborts, Ray kills nobody) and comes back as Ray's actor death, so dispatch marks
    the actor dead and re-sends its rows; the router's other calls are untouched."""
    transport: RdtTransport = routers["rdt"].transport
    victim, other = "expert-e1-r1", "expert-e2-r1"
    rows = pack(torch.randn(3, transport_hidden(routers)))
    calls = [transport.submit(name, 0, [1 if name == victim else 2], [3], rows) for name in (victim, other)]
    ray.wait([c.result for c in calls], num_returns=2, timeout=60)
    kill_and_wait(victim)
    started = time.monotonic()
    dead, alive = transport.gather_settled(calls, timeout=30)
    assert time.monotonic() - started < 20
    assert isinstance(dead, ray.exceptions.RayActorError), dead
    assert isinstance(alive, torch.Tensor) and alive.shape == (3, transport_hidden(routers))
    assert ray.get(ray.get_actor(other, namespace=NAMESPACE).ready.remote(), timeout=30)  # not killed by Ray
    # Later tests connect to every actor by name: wait for the controller's restore. A restored actor that is still
    # loading (slow on a loaded 2-core machine) times out its `ready` call: ask again until the budget is spent.
    wait_for(lambda: ray.get(ray.get_actor(victim, namespace=NAMESPACE).ready.remote(), timeout=30), 180,
             f"{victim} restored", every=0.5,
             ignore=(ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError))


def transport_hidden(routers) -> int:
    return routers["rdt"].model_config.hidden_size


def test_compiled_teardown_leaves_no_loop_or_channel(mesh):
    actors = connect_actors(mesh.pool.spec)  # the current incarnations (earlier tests had two restored)
    router = Router(mesh.pool.spec, actors, mesh.config.replace(**{"router.transport": "compiled"}))
    transport: CompiledGraphTransport = router.transport
    graph = transport.graph
    assert graph is not None
    loops = list(graph.dag.worker_task_refs.values())
    router.close()
    assert transport.graph is None and graph.dag._is_teardown
    done, running = ray.wait(loops, num_returns=len(loops), timeout=30)
    assert not running  # every actor's execution loop has exited
    assert all(not t.is_alive() for t in transport._teardowns)
    # The actors are free again: plain calls, and a new graph compiles on them.
    assert all(ray.get([h.ready.remote() for h in actors.values()], timeout=30))
    again = CompiledGraphTransport(actors, background=False)
    assert again.wait_built(60)
    again.close()


def test_an_idle_compiled_graph_is_torn_down_and_rebuilt_on_demand(mesh):
    """Ray's execution loops poll while idle; the transport stops them after idle_teardown_s."""
    actors = connect_actors(mesh.pool.spec)
    transport = CompiledGraphTransport(actors, idle_teardown_s=1.0)
    try:
        assert transport.wait_built(60)
        loops = list(transport.graph.dag.worker_task_refs.values())
        wait_for(lambda: transport.graph is None, 20, "the idle graph to be torn down", every=0.2)
        _, running = ray.wait(loops, num_returns=len(loops), timeout=30)
        assert not running
        name = sorted(actors)[0]
        layer, expert = mesh.pool.spec.actor_shards[name][0]
        x = pack(torch.randn(3, mesh.model_config.hidden_size))
        want = ray.get(actors[name].forward.remote(layer, [expert], [3], x))
        got = transport.gather_settled([transport.submit(name, layer, [expert], [3], x)], 30)[0]
        assert torch.equal(got, to_tensor(want))  # served by plain calls while it rebuilds
        assert transport.wait_built(60) and transport.builds == 2
    finally:
        transport.close()
