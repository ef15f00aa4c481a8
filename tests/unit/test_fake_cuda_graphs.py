"""CUDA graphs under the fake-CUDA double (ops/fake_cuda/graphs.py): a replay re-runs what the capture recorded on
the recorded tensors, and each mistake graph code makes on a real GPU fails here too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.fakes import host

NOT_PERMITTED = "operation not permitted when stream is capturing"


def _mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = F.silu(F.linear(x, w))  # [B, H]
    return torch.softmax(h, dim=-1) * 2 + x


def test_replay_recomputes_from_what_was_copied_into_the_static_input(fc):
    w = torch.randn(8, 8, device="cuda")
    static = torch.zeros(4, 8, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _mlp(static, w)
    assert g.num_ops > 0
    for seed in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        static.copy_(x.to("cuda"))
        g.replay()
        assert torch.equal(host(out), _mlp(x, host(w)))


def test_a_capture_only_records_its_outputs_hold_nothing_until_a_replay(fc):
    w = torch.randn(8, 8, device="cuda")
    static = torch.randn(4, 8, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _mlp(static, w)
        ids = static.argmax(-1)
    assert torch.isnan(host(out)).all() and (host(ids) == torch.iinfo(torch.int64).min).all()
    g.replay()
    assert torch.equal(host(out), _mlp(host(static), host(w)))
    assert torch.equal(host(ids), host(static).argmax(-1))


def test_a_new_tensor_bound_to_the_input_name_is_never_read(fc):
    """The classic mistake: rebinding instead of copying. The replay still reads the captured memory."""
    w = torch.randn(8, 8, device="cuda")
    static = torch.zeros(4, 8, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _mlp(static, w)
    static = torch.randn(4, 8, device="cuda")  # noqa: F841 - rebound, not copied
    g.replay()
    assert torch.equal(host(out), _mlp(torch.zeros(4, 8), host(w)))


def test_in_place_writes_and_views_of_static_memory_replay(fc):
    pool = torch.zeros(6, 3, device="cuda")
    slots = torch.zeros(2, dtype=torch.int64, device="cuda")
    rows = torch.zeros(2, 3, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pool.index_copy_(0, slots, rows * 2)
        total = pool[:4].sum(0)  # a view of static memory, then a reduction
    slots.copy_(torch.tensor([1, 3]).to("cuda"))
    rows.copy_(torch.ones(2, 3).to("cuda"))
    g.replay()
    assert host(pool)[[1, 3]].eq(2).all() and torch.equal(host(total), torch.full((3,), 4.0))


def test_attention_above_aten_is_recorded(fc):
    q = torch.zeros(1, 2, 1, 4, device="cuda")
    k = torch.zeros(1, 2, 5, 4, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o = F.scaled_dot_product_attention(q, k, k)
    qq, kk = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 5, 4)
    q.copy_(qq.to("cuda"))
    k.copy_(kk.to("cuda"))
    g.replay()
    assert torch.equal(host(o), F.scaled_dot_product_attention(qq, kk, kk))


@pytest.mark.parametrize("mistake", [
    lambda x: int(x.sum()),  # a device read
    lambda x: x.tolist(),
    lambda x: x[x > 0],  # a device mask as an index: its size is read back
    lambda x: x.nonzero(),
    lambda x: torch.cuda.synchronize(),
    lambda x: x + torch.tensor([1.0, 2.0], device="cuda"),  # host data copied up inside the capture
    lambda x: x + torch.ones(2).to("cuda"),
    lambda x: x.copy_(torch.ones(2)),
], ids=["int", "tolist", "mask-index", "nonzero", "synchronize", "tensor-on-device", "to-cuda", "copy-from-host"])
def test_what_cannot_be_captured_raises_as_on_cuda(fc, mistake):
    x = torch.ones(2, device="cuda")
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=NOT_PERMITTED):
        with torch.cuda.graph(g):
            assert torch.cuda.is_current_stream_capturing()
            mistake(x)
    assert not torch.cuda.is_current_stream_capturing()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()  # an abandoned capture cannot be replayed


def test_factories_inside_a_capture_are_kernels_not_copies(fc):
    n = torch.zeros(3, dtype=torch.int64, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mask = torch.arange(4, device="cuda")[None, :] < n[:, None]  # [3, 4]
    n.copy_(torch.tensor([1, 2, 4]).to("cuda"))
    g.replay()
    assert host(mask).sum(1).tolist() == [1, 2, 4]


def test_entering_a_capture_synchronizes_once_and_replays_read_nothing(fc):
    x = torch.ones(2, device="cuda")
    g = torch.cuda.CUDAGraph()
    with fc.counting() as capture:
        with torch.cuda.graph(g):
            y = x * 3
    with fc.counting() as replay:
        for _ in range(5):
            g.replay()
    assert capture.syncs == 1 and capture.host_reads == 0
    assert replay.total == 0 and torch.equal(host(y), torch.full((2,), 3.0))


def test_a_factory_inside_a_capture_runs_again_at_each_replay(fc):
    """torch.zeros then scatter_: each replay starts from zeros (a memset kernel in the graph), not from what the
    previous replay scattered."""
    best = torch.zeros(2, 1, dtype=torch.int64, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chosen = torch.zeros(2, 3, dtype=torch.bool, device="cuda")
        chosen.scatter_(1, best, True)
    for picks in ([[0], [1]], [[2], [2]]):
        best.copy_(torch.tensor(picks).to("cuda"))
        g.replay()
        assert host(chosen).sum().item() == 2 and host(chosen).gather(1, torch.tensor(picks)).all()
