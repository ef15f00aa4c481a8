"""`expertmesh serve --model org/name` from a stand-in Hub (tests/hub_server.py; HF_ENDPOINT points at it, online):
every process downloads the bytes it reads, counted per process by the stand-in — the driver headers only, the
router replica the dense tensors, each expert actor its shards' tensors — from a checkpoint whose files mix
attention and experts of several layers; two replicas of an expert on the node fetch its tensors once; a restored
actor fetches nothing; the answers equal the in-process reference read from the local folder.

The server joins a Ray this module starts (tests/served.py:server_on_own_ray), so the test can ask actors for their
pid and shards and kill one. One node, one Hub cache: what the node's processes fetch adds up to the checkpoint's
bytes needed, once.
"""

from __future__ import annotations

import os
import time

import grpc
import pytest
import ray

from expertmesh.cluster.naming import NAMESPACE
from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.reference import load_reference_model
from expertmesh.experts.weights import dense_tensor_names, expert_shard_bytes, expert_shard_names
from tests.hub_server import StandInHub, bytes_by_tensor
from tests.served import generate_ids, server_on_own_ray
from tests.tiny_checkpoints import greedy_tokens, write_mixed_shards
from tests.traffic import wait_for

REPO = "acme/mixed-mixtral"
LAYERS, EXPERTS, REPLICAS = 4, 4, 2
PROMPT = [5, 17, 42, 9, 61, 3]
MAX_TOKENS = 6

# Not slow-marked: the only end-to-end test of range reads through real actors (~1-3 min on 2 cores: eight actors
# import torch), so CI runs it.


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_mixed_shards(tmp_path_factory.mktemp("mixed") / "m", files=3, seed=11, layers=LAYERS,
                              experts=EXPERTS, hidden=64, inter=256)


@pytest.fixture(scope="module")
def hub(folder):
    with StandInHub() as server:
        server.add(REPO, folder)
        yield server


@pytest.fixture(scope="module")
def served(hub, tmp_path_factory):
    """The server and every Ray worker see the stand-in as the Hub (the environment Ray and the server start with)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_ENDPOINT", hub.url)
        mp.setenv("HF_HUB_CACHE", str(tmp_path_factory.mktemp("node-cache")))
        mp.delenv("HF_HUB_OFFLINE", raising=False)
        mp.delenv("TRANSFORMERS_OFFLINE", raising=False)
        with server_on_own_ray("--model", REPO, "--replicas-per-expert", str(REPLICAS), "--cpus-per-actor",
                               "0.25") as server:
            yield server


def _actors() -> dict[str, dict]:
    names = [f"expert-e{e}-r{r}" for e in range(EXPERTS) for r in range(REPLICAS)]
    return {n: ray.get(ray.get_actor(n, namespace=NAMESPACE).info.remote(), timeout=30) for n in names}


def test_each_process_fetches_what_it_reads_and_answers_as_the_folder(served, hub, folder):
    with grpc.insecure_channel(served.target) as channel:
        got = generate_ids(channel, PROMPT, MAX_TOKENS)
    assert got == greedy_tokens(load_reference_model(folder), PROMPT, MAX_TOKENS), served.log()
    local = CheckpointReader(folder)
    size = {name: local.nbytes([name]) for name in local.keys()}
    rows = []

    # The driver (the server process): config, index, headers; no tensor.
    driver = hub.served(pid=served.proc.pid)
    per_tensor, other = bytes_by_tensor(driver, folder)
    assert driver and per_tensor == {}, per_tensor
    rows.append(("driver", sum(s.nbytes for s in driver), 0))

    # The router replica: exactly the dense tensors.
    router = [s for s in hub.served() if "ServeReplica" in s.command and "router" in s.command]
    per_tensor, other = bytes_by_tensor(router, folder)
    dense = dense_tensor_names(local.config)
    assert per_tensor == {name: size[name] for name in dense}
    rows.append(("router", sum(s.nbytes for s in router), sum(size[n] for n in dense)))

    # Each expert actor: only its shards' tensors, at most 1.1 x their bytes; the two replicas of an expert share the
    # node's cache, so between them each tensor comes once.
    actors = _actors()
    fetched: dict[str, int] = {}
    for name, info in sorted(actors.items()):
        mine = hub.served(pid=info["pid"])
        per_tensor, other = bytes_by_tensor(mine, folder)
        shards = [tuple(s) for s in info["shards"]]
        names = set(expert_shard_names(local.config, shards))
        assert set(per_tensor) <= names, (name, set(per_tensor) - names)
        shard_bytes = expert_shard_bytes(local, shards)
        total = sum(s.nbytes for s in mine)
        assert total <= 1.1 * shard_bytes, (name, total, shard_bytes)
        rows.append((name, total, shard_bytes))
        for tensor, n in per_tensor.items():
            fetched[tensor] = fetched.get(tensor, 0) + n
    every_shard = [(layer, e) for layer in range(LAYERS) for e in range(EXPERTS)]
    assert fetched == {name: size[name] for name in expert_shard_names(local.config, every_shard)}

    # Nobody else (controller, Serve's processes) fetched a tensor.
    known = {served.proc.pid} | {info["pid"] for info in actors.values()} | {s.pid for s in router}
    strays = bytes_by_tensor([s for s in hub.served() if s.pid not in known], folder)[0]
    assert strays == {}, strays
    print("\nbytes fetched per process (role, fetched, its tensors' bytes):")
    for role, total, own in rows:
        print(f"  {role:<14} {total:>9} {own:>9}" + (f"  {total / own:.3f}x" if own else ""))


def test_a_restored_actor_fetches_nothing(served, hub):
    before = _actors()["expert-e1-r0"]
    hub.reset()
    ray.kill(ray.get_actor("expert-e1-r0", namespace=NAMESPACE), no_restart=True)

    def restored() -> dict | None:
        info = ray.get(ray.get_actor("expert-e1-r0", namespace=NAMESPACE).info.remote(), timeout=10)
        return info if info["pid"] != before["pid"] else None

    started = time.monotonic()
    info = wait_for(restored, 120, "expert-e1-r0 restored", every=0.5, ignore=(Exception,))
    print(f"\nrestored in {time.monotonic() - started:.1f}s as pid {info['pid']}")
    assert info["shards"] == before["shards"] and info["generation"] == before["generation"] + 1
    # The pinned commit: config, headers and pieces all come from the node's cache, without a request to the repo.
    # (huggingface_hub itself may ask for /api/agent-harnesses when it builds its user agent: not the repo's.)
    assert [s for s in hub.served(pid=info["pid"]) if s.repo] == []
    assert sum(s.nbytes for s in hub.served(pid=info["pid"])) == 0
    assert os.getpid() not in {s.pid for s in hub.served()}
