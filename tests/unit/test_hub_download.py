"""Hub downloads that fit: against a stand-in Hub (tests/hub_server.py, HF_ENDPOINT pointed at it, online), each role
fetches the bytes of the tensors it reads and no others, although every file of the checkpoint mixes attention and
experts of several layers; a second open on the node fetches nothing; concurrent readers fetch a tensor once.
No Ray: the roles are their reads (experts/actor.py, router_service/router.py, router_service/startup.py)."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from expertmesh.experts.checkpoint import CheckpointReader
from expertmesh.experts.errors import CheckpointError
from expertmesh.experts.model_source import METADATA_FILES, dense_tensors, open_checkpoint, shard_tensors
from expertmesh.experts.weights import (
    check_checkpoint,
    dense_tensor_names,
    expert_shard_bytes,
    expert_shard_names,
    load_dense_weights,
    load_expert_shards,
)
from tests.hub_server import StandInHub, bytes_by_tensor
from tests.tiny_checkpoints import write_hf_checkpoint, write_mixed_shards

REPO = "acme/mixed-mixtral"
LAYERS, EXPERTS = 4, 4
SIZES = dict(layers=LAYERS, experts=EXPERTS, hidden=64, inter=256)  # a shard (w1, w2, w3) is 192 KiB in f32


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A Mixtral checkpoint in 3 files, each mixing experts and attention of two or more layers."""
    folder = write_mixed_shards(tmp_path_factory.mktemp("mixed") / "m", files=3, seed=5, **SIZES)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    for filename in set(weight_map.values()):
        names = [n for n, f in weight_map.items() if f == filename]
        assert any(".experts." in n for n in names) and any("self_attn" in n for n in names)
        assert len({n.split(".")[2] for n in names if n.startswith("model.layers.")}) >= 2
    return folder


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A running stand-in Hub, huggingface_hub pointed at it (online), an empty node cache, no token."""
    from huggingface_hub import constants

    with StandInHub() as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            server.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "")
        yield server


def _fetched(hub, folder):
    """(tensor -> bytes, other bytes, total bytes) this process was served since the last reset."""
    served = hub.served(pid=os.getpid())
    per_tensor, other = bytes_by_tensor(served, folder)
    return per_tensor, other, sum(s.nbytes for s in served)


def _equal_shards(got, want) -> bool:
    return all(torch.equal(got[s].gate_up, want[s].gate_up) and torch.equal(got[s].down, want[s].down) for s in want)


def test_an_expert_actor_fetches_its_shards_bytes_and_nothing_else(hub, mixed):
    hub.add(REPO, mixed)
    shards = [(layer, 1) for layer in range(LAYERS)]  # the default layout: one expert of every layer
    local = CheckpointReader(mixed)
    reader = open_checkpoint(REPO, None, shard_tensors(shards))  # what ExpertActor.__init__ does
    got = load_expert_shards(reader, shards)
    assert _equal_shards(got, load_expert_shards(local, shards))
    per_tensor, other, total = _fetched(hub, mixed)
    names = expert_shard_names(local.config, shards)
    assert per_tensor == {name: local.nbytes([name]) for name in names}  # each of its tensors once, nothing else
    shard_bytes = expert_shard_bytes(local, shards)
    assert total <= 1.1 * shard_bytes, (total, shard_bytes, other)
    # Merged requests: one per (layer, expert) run of w1, w2, w3 (they sit side by side in their file).
    ranges = [s for s in hub.served(pid=os.getpid()) if s.range and s.range[1] - s.range[0] > 8 and
              s.range[0] > 8 + 4096]
    assert len(ranges) == LAYERS


def test_the_router_fetches_dense_tensors_only(hub, mixed):
    hub.add(REPO, mixed)
    local = CheckpointReader(mixed)
    reader = open_checkpoint(REPO, None, dense_tensors)  # what Router.__init__ does
    dense = load_dense_weights(reader)
    want = load_dense_weights(local)
    assert torch.equal(dense.embed, want.embed) and torch.equal(dense.lm_head, want.lm_head)
    assert all(torch.equal(a.attention.q, b.attention.q) and torch.equal(a.router, b.router)
               for a, b in zip(dense.layers, want.layers, strict=True))
    per_tensor, other, total = _fetched(hub, mixed)
    assert not [name for name in per_tensor if ".experts." in name]
    assert per_tensor == {name: local.nbytes([name]) for name in dense_tensor_names(local.config)}
    assert total <= 1.1 * local.nbytes(dense_tensor_names(local.config)) + 16 * 1024  # + config, index, headers


def test_the_driver_fetches_config_index_and_headers_only(hub, mixed):
    hub.add(REPO, mixed)
    reader = open_checkpoint(REPO, None, dense_tensors)  # start_mesh, before any actor starts
    check_checkpoint(reader)  # every tensor's shape, from the headers
    local = CheckpointReader(mixed)
    shards = [(layer, e) for layer in range(LAYERS) for e in range(EXPERTS)]
    assert expert_shard_bytes(reader, shards) == expert_shard_bytes(local, shards)  # gpu_fit's arithmetic
    per_tensor, other, total = _fetched(hub, mixed)
    assert per_tensor == {}
    files = {s.file for s in hub.served()}
    assert files == set(METADATA_FILES) | {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    assert total == other == (sum((mixed / f).stat().st_size for f in ("config.json", "model.safetensors.index.json"))
                              + local.header_bytes())
    assert reader.header_bytes() == local.header_bytes()


def test_a_second_open_on_the_node_fetches_nothing(hub, mixed):
    commit = hub.add(REPO, mixed)
    shards = [(layer, 2) for layer in range(LAYERS)]
    first = load_expert_shards(open_checkpoint(REPO, None, shard_tensors(shards)), shards)
    hub.reset()
    again = load_expert_shards(open_checkpoint(REPO, None, shard_tensors(shards)), shards)  # a restarted actor
    assert _equal_shards(again, first)
    assert sum(s.nbytes for s in hub.served()) == 0  # "main" is checked (HEAD requests), no byte moves
    hub.reset()
    pinned = open_checkpoint(REPO, commit, shard_tensors(shards))  # start_mesh hands its actors the commit
    assert pinned.commit == commit
    assert _equal_shards(load_expert_shards(pinned, shards), first)
    assert hub.served() == []  # not even a request


def test_concurrent_readers_on_a_node_fetch_each_tensor_once(tmp_path, monkeypatch, mixed):
    from huggingface_hub import constants

    with StandInHub(range_delay_s=0.05) as server:  # slow answers: the readers overlap in time
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            server.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        commit = server.add(REPO, mixed)
        open_checkpoint(REPO, commit, shard_tensors([]))  # small files in the cache first (huggingface_hub's part)
        server.reset()
        shard_sets = [[(layer, 0) for layer in range(LAYERS)], [(layer, e) for layer in range(LAYERS) for e in (0, 1)],
                      [(layer, 0) for layer in range(LAYERS)]]  # two replicas of expert 0 and one actor of 0 and 1
        start = threading.Barrier(len(shard_sets))
        results: list = [None] * len(shard_sets)

        def actor(i: int) -> None:
            reader = open_checkpoint(REPO, commit, shard_tensors(shard_sets[i]))
            start.wait()
            results[i] = load_expert_shards(reader, shard_sets[i])

        threads = [threading.Thread(target=actor, args=(i,)) for i in range(len(shard_sets))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        local = CheckpointReader(mixed)
        for shards, got in zip(shard_sets, results, strict=True):
            assert got is not None and _equal_shards(got, load_expert_shards(local, shards))
        per_tensor, _ = bytes_by_tensor(server.served(), mixed)
        names = expert_shard_names(local.config, shard_sets[1])
        assert per_tensor == {name: local.nbytes([name]) for name in names}  # every tensor exactly once


def test_a_gated_repo_needs_hf_token_for_every_request(hub, mixed, monkeypatch):
    hub.add("acme/gated", mixed, token="s3cret")
    with pytest.raises(CheckpointError, match="acme/gated: no such repository .*set HF_TOKEN"):
        open_checkpoint("acme/gated", None, shard_tensors([(0, 0)]))
    monkeypatch.setenv("HF_TOKEN", "s3cret")
    reader = open_checkpoint("acme/gated", None, shard_tensors([(0, 0)]))
    got = load_expert_shards(reader, [(0, 0)])
    assert _equal_shards(got, load_expert_shards(CheckpointReader(mixed), [(0, 0)]))
    ok = [s for s in hub.served() if s.status in (200, 206)]
    assert any(s.range for s in ok)  # the range requests carried the token too (a 401 would have failed the read)


def test_stacked_experts_fetch_only_their_rows(hub, tmp_path):
    folder = write_hf_checkpoint("mixtral", tmp_path / "fused", seed=4, max_shard_size="40KB", fused=True,
                                 num_hidden_layers=3)
    hub.add("acme/stacked", folder)
    shards = [(1, 0), (1, 3), (2, 3)]
    local = CheckpointReader(folder)
    reader = open_checkpoint("acme/stacked", None, shard_tensors(shards))
    assert _equal_shards(load_expert_shards(reader, shards), load_expert_shards(local, shards))
    per_tensor, other, total = _fetched(hub, folder)
    assert sum(per_tensor.values()) == expert_shard_bytes(local, shards)  # rows only: 3/4 of no stacked tensor
    assert all(".experts." in name for name in per_tensor)


def test_a_server_that_ignores_ranges_is_an_error_not_a_whole_download(tmp_path, monkeypatch, mixed):
    from huggingface_hub import constants

    with StandInHub(ignore_ranges=True) as server:
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            server.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        server.add(REPO, mixed)
        with pytest.raises(CheckpointError, match=r"did not answer a range request for model-0000\d-of-00003"):
            open_checkpoint(REPO, None, shard_tensors([(0, 0)]))
        assert not [p for p in (tmp_path / "hub").rglob("*.safetensors") if p.is_file()]  # no piece, no file


def test_offline_after_an_online_run_reads_the_node_cache(hub, mixed, monkeypatch):
    from huggingface_hub import constants

    hub.add(REPO, mixed)
    shards = [(0, 3), (3, 3)]
    first = load_expert_shards(open_checkpoint(REPO, None, shard_tensors(shards)), shards)
    hub.reset()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    reader = open_checkpoint(REPO, None, shard_tensors(shards))
    assert _equal_shards(load_expert_shards(reader, shards), first)
    assert hub.served() == []
    with pytest.raises(CheckpointError, match=f"{REPO}: model-0000.-of-00003.safetensors|{REPO}: tensor"):
        load_expert_shards(reader, [(1, 0)])  # never fetched here


def test_an_unsharded_repo_reads_ranges_of_its_one_file(hub, checkpoints):
    folder = checkpoints["direct"]  # model.safetensors, no index
    hub.add("acme/direct", folder)
    local = CheckpointReader(folder)
    reader = open_checkpoint("acme/direct", None, shard_tensors([(1, 2)]))
    assert set(reader.keys()) == set(local.keys())
    assert _equal_shards(load_expert_shards(reader, [(1, 2)]), load_expert_shards(local, [(1, 2)]))
    per_tensor, _, _ = _fetched(hub, folder)
    assert set(per_tensor) == set(expert_shard_names(local.config, [(1, 2)]))


def test_plan_cluster_on_a_repo_reads_headers_only(hub, mixed, capsys):
    from expertmesh.ops.cli import main

    hub.add(REPO, mixed)
    args = ["plan-cluster", "--gpu-type", "L4", "--gpus-per-node", "4", "--json"]
    assert main([*args, "--model", REPO]) == 0
    from_hub = json.loads(capsys.readouterr().out)
    assert main([*args, "--model", str(mixed)]) == 0
    from_folder = json.loads(capsys.readouterr().out)
    assert from_hub["disk_bytes"] == from_folder["disk_bytes"]
    assert from_hub["fits"][0]["expert_node_disk_bytes"] == from_folder["fits"][0]["expert_node_disk_bytes"]
    per_tensor, other, total = _fetched(hub, mixed)
    assert per_tensor == {} and total == from_hub["disk_bytes"]["head"]  # the head's figure is what it fetched
