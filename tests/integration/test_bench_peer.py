"""`bench serve --peer`'s launcher (ops/bench/peer_server.py): `transformers serve` started offline on the embedded
checkpoint on a port the OS picks, answering the neutral client, stopped with nothing left behind (~20 s). Failed
starts are tested on fake commands (tests/unit/test_bench_peer.py). No Ray. The whole bench is `slow`."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import pytest

from expertmesh.experts.embedded_model import EMBEDDED_MODEL_DIR
from expertmesh.ops.bench.openai_load import Target, level_record, probe_target, run_level
from expertmesh.ops.bench.peer_server import cache_args, group_members, missing_packages, start_peer

pytestmark = pytest.mark.skipif(bool(missing_packages()), reason=f"transformers serve needs {missing_packages()}")


def _port_open(url: str) -> bool:
    host, port = url.rsplit("//", 1)[1].split(":")
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


def test_peer_starts_serves_and_stops_cleanly():
    started = time.perf_counter()
    peer = start_peer(str(EMBEDDED_MODEL_DIR), tuple(cache_args((), 2, 512)), timeout=120)
    try:
        assert peer.base_url.startswith("http://127.0.0.1:") and not peer.base_url.endswith(":8000")
        target = asyncio.run(probe_target(Target("peer", peer.base_url)))
        assert target.model == str(EMBEDDED_MODEL_DIR)
        assert not target.ignore_eos and "ignore_eos refused (422" in target.notes[0]
        replies, wall = asyncio.run(run_level(target, [["def add(a, b):"], ["class Node:"]], 4, stream=False))
        record = level_record(replies, wall, 4)
        assert record["errors"] == {} and record["completion_tokens"] == 8, record
        (streamed,), _ = asyncio.run(run_level(target, [["import os"]], 3, stream=True))
        assert streamed.error is None and streamed.first_token is not None and streamed.completion_tokens == 3
    finally:
        code = peer.stop(grace_s=3)  # SIGINT leaves a continuous-batching peer running: SIGTERM after 3 s
    assert peer.stop_signal in ("SIGINT", "SIGTERM"), peer.log()  # never needed SIGKILL
    assert code is not None and group_members(peer.proc.pid) == []
    assert not _port_open(peer.base_url)
    print(f"peer start {peer.start_s} s, whole test {time.perf_counter() - started:.1f} s, stopped by "
          f"{peer.stop_signal} (exit {code})")


@pytest.mark.slow
def test_bench_serve_peer_end_to_end(tmp_path):
    """Both servers, one round, two levels of each workload: the JSON and the chart, every request answered."""
    out = tmp_path / "peer.json"
    subprocess.run([sys.executable, "-m", "expertmesh.ops.cli", "bench", "serve", "--peer", "--concurrency", "1,4",
                    "--rounds", "1", "--max-tokens", "8", "--out", str(out)], check=True, timeout=900,
                   stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    assert (tmp_path / "peer.png").stat().st_size > 10_000
    for workload in ("distinct", "shared"):
        for c in ("1", "4"):
            entry = result["summary"][workload][c]
            assert entry["expertmesh"]["errors"] == entry["peer"]["errors"] == 0
            assert entry["ratio"]["tokens_per_s"] is not None
    assert result["summary"]["shared"]["4"]["ratio"]["ttft"] is not None
    assert all(lv["exact_max_tokens"] == lv["requests"] for lv in result["levels"] if lv["server"] == "expertmesh")
    assert result["expertmesh_exit"]["code"] == 0 and result["peer_exit"]["signal"] != "SIGKILL"
