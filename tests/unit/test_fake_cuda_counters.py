"""The fake-CUDA double's counters and torch.cuda stand-ins: device-to-host reads, syncs and data-dependent shapes
are counted where CUDA makes the host wait, nothing else is, and everything is put back when the context closes.
"""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
import torch.nn.functional as F

from expertmesh.ops.fake_cuda import FakeCudaTensor, fake_cuda


def counted(fc, fn) -> tuple[int, int, int]:
    with fc.counting() as c:
        fn()
    return c.host_reads, c.syncs, c.shape_syncs


def test_device_work_is_not_a_read(fc):
    x = torch.randn(8, 16, device="cuda")
    w = torch.randn(4, 16, device="cuda")

    def step():
        logits = F.linear(x, w).float()
        probs = F.softmax(logits, -1)
        top = torch.topk(probs, 2)
        order = torch.sort(top.indices.flatten(), stable=True)
        x[0] = probs.argmax()  # a device 0-dim value written to the device: no read
        return torch.where(probs > 0.5, probs, torch.tensor(0.0)), order, x.sum(), x[x.sum(-1) > 0, 0]

    assert counted(fc, step) == (0, 0, 1)  # the only wait: x[device mask] needs nonzero's size


@pytest.mark.parametrize("read", [
    lambda t: t.sum().item(), lambda t: int(t.sum()), lambda t: float(t[0]), lambda t: bool(t[0] > 0),
    lambda t: t.tolist(), lambda t: t.cpu(), lambda t: t.to("cpu"), lambda t: t.to("cpu", torch.float16),
    lambda t: torch.equal(t, t), lambda t: [0, 1, 2][t[0].long()], lambda t: f"{t[0]:.2f}",
    lambda t: t.numpy(force=True), lambda t: torch.empty(4).copy_(t), lambda t: range(t.long().max()),
    lambda t: t.masked_fill(t > 0, t[0]), lambda t: F.one_hot((t * 3).long()),
], ids=["item", "int", "float", "bool", "tolist", "cpu", "to_cpu", "to_cpu_dtype", "equal", "index", "format",
        "numpy_force", "copy_to_host", "range", "masked_fill_device_value", "one_hot_without_num_classes"])
def test_each_device_to_host_read_counts_once(fc, read):
    t = torch.rand(4, device="cuda")
    assert counted(fc, lambda: read(t)) == (1, 0, 0)


def test_python_surface_reads(fc):
    x = torch.arange(4.0, device="cuda")
    model = torch.nn.Linear(4, 2).cuda()
    assert counted(fc, lambda: (repr(x), str(x), copy.deepcopy(model), x.shape, len(x), list(x))) == (0, 0, 0)
    clone = copy.deepcopy(model)
    assert isinstance(clone.weight, FakeCudaTensor) and isinstance(clone.weight, torch.nn.Parameter)
    buffer = io.BytesIO()
    assert counted(fc, lambda: torch.save(x, buffer)) == (1, 0, 0)  # pickling copies to the host
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, FakeCudaTensor) and torch.equal(loaded._elem, x._elem)
    with fc.counting() as c:
        built = torch.tensor([x[1], x[2]], device="cuda")  # each device value is read to build the list
    assert c.host_reads == 2 and isinstance(built, FakeCudaTensor) and built._elem.tolist() == [1.0, 2.0]


def test_non_blocking_copies_to_pinned_memory_are_not_reads(fc):
    t = torch.rand(4, device="cuda")
    pinned, pageable = torch.empty(4, pin_memory=True), torch.empty(4)
    assert counted(fc, lambda: pinned.copy_(t, non_blocking=True)) == (0, 0, 0)
    assert counted(fc, lambda: pageable.copy_(t, non_blocking=True)) == (1, 0, 0)  # pageable memory waits
    assert counted(fc, lambda: pinned.copy_(t)) == (1, 0, 0)  # a blocking copy waits whatever the memory
    with fc.counting() as c:
        staged = t.to("cpu", non_blocking=True)
    assert c.host_reads == 0 and staged.is_pinned()  # _to_copy pins a non_blocking device-to-host result
    assert counted(fc, lambda: torch.cuda.synchronize()) == (0, 1, 0)
    assert torch.equal(staged, pinned) and torch.equal(staged, t._elem)


def test_host_to_device_moves_are_not_reads(fc):
    cpu = torch.arange(4.0)
    assert counted(fc, lambda: (cpu.cuda(), cpu.to("cuda", non_blocking=True),
                                torch.empty(4, device="cuda").copy_(cpu), torch.tensor([1, 2], device="cuda"))) \
        == (0, 0, 0)


def test_syncs_count_separately(fc):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.Stream()

    def waits():
        start.record()
        torch.cuda.synchronize()
        torch.cuda.synchronize(torch.device("cuda"))
        end.record(stream)
        end.synchronize()
        assert end.query() and stream.query()
        stream.synchronize()

    assert counted(fc, waits) == (0, 6, 0)
    assert start.elapsed_time(end) >= 0.0
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        torch.cuda.Event().elapsed_time(end)


@pytest.mark.parametrize("op, reads, shape_syncs", [
    (lambda x: torch.nonzero(x > 1), 0, 1), (lambda x: x[x > 1], 0, 1), (lambda x: x.masked_select(x > 1), 0, 1),
    (lambda x: torch.unique_consecutive(x, return_counts=True), 0, 1), (lambda x: torch.bincount(x), 0, 1),
    (lambda x: torch.repeat_interleave(x), 0, 1), (lambda x: torch.repeat_interleave(x, x, output_size=9), 0, 0),
    (lambda x: torch.unique(x), 0, 1), (lambda x: x[x.cpu() > 1], 1, 0), (lambda x: x.masked_fill(x > 1, 0), 0, 0),
    (lambda x: F.one_hot(x, 4), 0, 0),
    (lambda x: x.__setitem__(x > 1, 0), 0, 0),  # a CPU scalar into a device mask: masked_fill_, no nonzero
    (lambda x: x.__setitem__(x > 1, torch.full((3,), 9, device="cuda")), 0, 1),  # index_put_ through nonzero
])
def test_data_dependent_shapes_count_as_shape_syncs(fc, op, reads, shape_syncs):
    x = torch.tensor([0, 2, 2, 1, 3, 1], device="cuda")
    assert counted(fc, lambda: op(x)) == (reads, 0, shape_syncs)


def test_call_sites_name_the_line_that_read(fc):
    x = torch.ones(3, device="cuda")
    n = int(x.sum())  # the first read
    torch.cuda.synchronize()
    for _ in range(2):
        x.tolist()
    sites = fc.read_sites
    assert fc.host_reads == 3 and n == 3
    lines = sorted(int(site.rsplit(":", 1)[1]) for site in sites.elements())
    assert all(site.startswith("tests/unit/test_fake_cuda_counters.py:") for site in sites)
    assert lines[1] == lines[2] == lines[0] + 3 and sites.most_common(1)[0][1] == 2
    assert list(fc.sync_sites.values()) == [1] and fc.syncs == 1


def test_reset_snapshot_and_nested_blocks(fc):
    x = torch.ones(2, device="cuda")
    x.tolist()
    before = fc.snapshot()
    with fc.counting() as outer:
        x.tolist()
        with fc.counting() as inner:
            torch.cuda.synchronize()
    assert (outer.host_reads, outer.syncs, inner.host_reads, inner.syncs) == (1, 1, 0, 1)
    assert (before.host_reads, fc.host_reads, fc.syncs, outer.total) == (1, 2, 1, 2)
    fc.reset()
    assert (fc.host_reads, fc.syncs, fc.shape_syncs, len(fc.read_sites)) == (0, 0, 0, 0)


def test_cuda_queries_report_the_fake_device():
    with fake_cuda(total_memory=2 * 2**30) as fc:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1 and torch.cuda.current_device() == 0
        assert torch.cuda.get_device_properties(0).total_memory == 2 * 2**30
        assert torch.cuda.get_device_name() and torch.cuda.is_bf16_supported()
        free0, total = torch.cuda.mem_get_info(torch.device("cuda"))
        block = torch.empty(2**20, device="cuda")  # 4 MiB
        view = block[: 2**10]  # shares the block's storage
        assert total == 2 * 2**30 and free0 - torch.cuda.mem_get_info()[0] == 4 * 2**20
        assert torch.cuda.memory_allocated() == 4 * 2**20 and view.is_cuda
        del block, view
        assert torch.cuda.memory_allocated() == 0 and torch.cuda.max_memory_allocated() == 4 * 2**20
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            assert torch.cuda.current_stream() is s
        assert torch.cuda.current_stream() is torch.cuda.default_stream()
        torch.cuda.empty_cache()
        with torch.cuda.device(0):
            pass
        assert fc.syncs == 0


def test_everything_is_restored_even_after_an_exception():
    originals = (torch.cuda.is_available, torch.cuda.synchronize, torch.Generator, torch.cuda.Event)
    with pytest.raises(ValueError), fake_cuda():
        assert torch.cuda.is_available()
        raise ValueError("boom")
    assert (torch.cuda.is_available, torch.cuda.synchronize, torch.Generator, torch.cuda.Event) == originals
    assert not torch.cuda.is_available()
    assert torch.__future__.get_overwrite_module_params_on_conversion() is False
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")  # the factories are CPU-only again
    assert isinstance(torch.Generator(), torch.Generator)


def test_the_double_does_not_nest():
    with fake_cuda(), pytest.raises(RuntimeError, match="already open"), fake_cuda():
        pass


def test_a_fake_tensor_outliving_the_context_still_computes_but_counts_nothing():
    with fake_cuda() as fc:
        x = torch.arange(3.0, device="cuda")
    assert isinstance(x + 1, FakeCudaTensor) and (x + 1)._elem.tolist() == [1.0, 2.0, 3.0]
    assert int(x.sum()) == 3 and fc.host_reads == 0


def test_worker_threads_opt_in(fc):
    made = []

    def worker():
        with fc.in_this_thread():
            made.append(torch.zeros(2, device="cuda"))
            made.append(int(made[0].sum()))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert isinstance(made[0], FakeCudaTensor) and fc.host_reads == 1
