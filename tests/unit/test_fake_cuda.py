"""The fake-CUDA double (ops/fake_cuda/): every CUDA device rule it claims raises where CUDA raises, the correct
form runs and computes exactly what the CPU computes, and the counters count device-to-host traffic and nothing else.

Each rule's test names where PyTorch decides it (the module docstring of ops/fake_cuda/rules.py has the detail).
Counting behaviour (reads, syncs, shape syncs, call sites) is in test_fake_cuda_counters.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from expertmesh.ops.fake_cuda import FakeCudaGenerator, FakeCudaTensor, fake_cuda
from expertmesh.ops.fake_cuda.rules import Kind, rule_for
from tests.fakes import host

MISMATCH = r"Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"
CPU_FIRST = r"Expected all tensors to be on the same device, but found at least two devices, cpu and cuda:0!"
aten = torch.ops.aten


def assert_same(fake: torch.Tensor, cpu: torch.Tensor) -> None:
    """On the fake device, and bit for bit what the CPU computed."""
    assert fake.device == torch.device("cuda", 0)
    assert fake.dtype == cpu.dtype and fake.shape == cpu.shape
    assert torch.equal(host(fake), cpu)


# --- factories and moves -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0), 0])
def test_factories_with_a_cuda_device_make_fake_tensors(fc, device):
    made = {
        "zeros": torch.zeros(2, 3, device=device), "ones": torch.ones(2, device=device, dtype=torch.bfloat16),
        "empty": torch.empty(4, device=device), "full": torch.full((2,), 7, device=device),
        "arange": torch.arange(5, device=device), "tensor": torch.tensor([1, 2], device=device),
        "as_tensor": torch.as_tensor([1.5], device=device), "eye": torch.eye(3, device=device),
        "linspace": torch.linspace(0, 1, 5, device=device), "zeros_like": torch.zeros_like(torch.ones(2),
                                                                                           device=device),
        "empty_strided": torch.empty_strided((2, 2), (1, 2), device=device),
        "rand": torch.rand(3, device=device), "randn": torch.randn(3, device=device),
        "randint": torch.randint(0, 9, (3,), device=device), "randperm": torch.randperm(5, device=device),
        "new_zeros": torch.ones(1).new_zeros(2, device=device),
    }
    for name, t in made.items():
        assert isinstance(t, FakeCudaTensor), name
        assert t.device == torch.device("cuda", 0) and t.is_cuda and t.get_device() == 0, name
    assert torch.equal(host(made["arange"]), torch.arange(5))
    assert torch.equal(host(made["linspace"]), torch.linspace(0, 1, 5))
    assert host(made["empty_strided"]).stride() == (1, 2)


def test_cpu_device_and_no_device_stay_on_the_cpu(fc):
    for t in (torch.zeros(2), torch.zeros(2, device="cpu"), torch.arange(3, device=torch.device("cpu"))):
        assert type(t) is torch.Tensor and t.device.type == "cpu"
    x = torch.ones(2, device="cuda")
    assert type(torch.zeros_like(x, device="cpu")) is torch.Tensor
    assert type(x.new_zeros(3, device="cpu")) is torch.Tensor


def test_a_second_device_is_an_invalid_ordinal(fc):
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.zeros(1, device="cuda:1")
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.ones(1).to("cuda:1")


def test_moves_to_the_device(fc):
    cpu = torch.arange(6.0).reshape(2, 3)
    for moved in (cpu.to("cuda"), cpu.cuda(), cpu.to(torch.device("cuda")), cpu.to("cuda", torch.float16),
                  cpu.to(device="cuda", non_blocking=True)):
        assert_same(moved, cpu.to(moved.dtype))
    on_device = cpu.cuda()
    assert host(on_device).data_ptr() != cpu.data_ptr()  # a move copies
    half = torch.zeros(1, device="cuda", dtype=torch.float16)
    assert_same(cpu.to(half), cpu.half())  # .to(other) takes its device and dtype
    assert on_device.to("cuda") is on_device and on_device.cuda() is on_device  # already there: no copy
    assert_same(on_device.to(torch.int64), cpu.long())
    like = torch.ones_like(on_device)
    assert_same(like, torch.ones(2, 3))
    assert_same(on_device.new_full((2,), 3.0), torch.full((2,), 3.0))
    assert_same(on_device.new_tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    back = on_device.cpu()
    assert type(back) is torch.Tensor and torch.equal(back, cpu)


def test_module_to_cuda_moves_parameters_and_buffers(fc):
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    cpu_model.register_buffer("scale", torch.tensor(2.0))
    ids = torch.tensor([[1, 2, 3]])
    expected = cpu_model(ids) * cpu_model.scale
    model = cpu_model.to("cuda")
    assert all(isinstance(p, FakeCudaTensor) and isinstance(p, torch.nn.Parameter) for p in model.parameters())
    assert isinstance(model.scale, FakeCudaTensor)
    with torch.inference_mode():
        out = model(ids.cuda()) * model.scale
    assert torch.equal(host(out), expected.detach())
    with pytest.raises(RuntimeError, match=MISMATCH):
        model(ids)  # the classic: a model on the GPU fed CPU token ids


def test_pinned_host_memory_is_marked(fc):
    buf = torch.empty(4, pin_memory=True)
    assert type(buf) is torch.Tensor and buf.is_pinned()
    plain = torch.zeros(4)
    assert not plain.is_pinned()
    pinned = plain.pin_memory()
    assert pinned.is_pinned() and pinned.pin_memory() is pinned and not plain.is_pinned()
    assert pinned[1:].is_pinned()  # a view of pinned memory is pinned
    with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
        torch.ones(2, device="cuda").pin_memory()
    assert not torch.ones(2, device="cuda").is_pinned()


# --- elementwise (TensorIterator: compute_types) -----------------------------------------------------------------

def test_elementwise_ops_refuse_a_cpu_operand_in_either_order(fc):
    x, c = torch.ones(3, device="cuda"), torch.ones(3)
    with pytest.raises(RuntimeError, match=MISMATCH):
        x + c
    with pytest.raises(RuntimeError, match=MISMATCH):
        c * x  # the common device is the first non-CPU operand, whichever side it is on
    with pytest.raises(RuntimeError, match=MISMATCH):
        torch.maximum(x, c)
    with pytest.raises(RuntimeError, match=MISMATCH):
        torch.gt(x, c)


def test_a_0dim_cpu_tensor_is_a_scalar_to_elementwise_ops(fc):
    cpu, s = torch.arange(4.0), torch.tensor(2.5)
    x = cpu.cuda()
    assert_same(x + s, cpu + s)
    assert_same(s * x, s * cpu)
    assert_same(x > s, cpu > s)
    assert_same(torch.lerp(x, x * 2, s), torch.lerp(cpu, cpu * 2, s))
    assert_same(torch.addcmul(x, s, x), torch.addcmul(cpu, s, cpu))
    assert_same(x.add_(s), cpu.add_(s))


def test_a_cpu_output_or_a_second_cpu_scalar_is_refused(fc):
    x, s = torch.ones(3, device="cuda"), torch.tensor(1.0)
    with pytest.raises(RuntimeError, match=MISMATCH):
        s.add_(torch.ones((), device="cuda"))  # a CPU tensor as the output: scalars are inputs only
    with pytest.raises(RuntimeError, match=MISMATCH):
        torch.add(x, x, out=torch.empty(3))
    with pytest.raises(RuntimeError, match="Trying to pass too many CPU scalars to non-CPU kernel!"):
        torch.add(s, s, out=torch.empty((), device="cuda"))
    with pytest.raises(RuntimeError, match=MISMATCH):
        x + torch.ones(1)  # one element is not 0-dim


def test_where_moves_every_0dim_cpu_operand_but_no_other(fc):
    cond_cpu, a = torch.tensor([True, False, True]), torch.arange(3.0)
    cond = cond_cpu.cuda()
    zero, one = torch.tensor(0.0), torch.tensor(1.0)
    assert_same(torch.where(cond, zero, one), torch.where(cond_cpu, zero, one))  # two CPU scalars: fine here
    assert_same(torch.where(cond, a.cuda(), zero), torch.where(cond_cpu, a, zero))
    with pytest.raises(RuntimeError, match=MISMATCH):
        torch.where(cond, a, a.cuda())
    with pytest.raises(RuntimeError, match=MISMATCH):
        torch.where(cond_cpu, a.cuda(), a.cuda())


def test_composites_decompose_under_inference_mode_too(fc):
    # inference_mode skips the autograd keys that decompose composite ops; the double decomposes them itself, so
    # float_power's TensorIterator parts take a 0-dim CPU exponent and linear's mm refuses a CPU weight
    x, w = torch.arange(1.0, 4.0), torch.ones(2, 3)
    with torch.inference_mode():
        assert_same(torch.float_power(x.cuda(), torch.tensor(2.0)), torch.float_power(x, torch.tensor(2.0)))
        with pytest.raises(RuntimeError, match=MISMATCH + r" \(when checking argument for argument mat2 in method "
                                                          r"wrapper_CUDA_mm\)"):
            F.linear(x[None].cuda(), w)


# --- generated ExactSame checks: matmul, cat, gather/scatter/index_* ------------------------------------------------

def test_matmul_and_linear_refuse_mixed_devices(fc):
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=MISMATCH + r" \(when checking argument for argument mat2 in method "
                                                      r"wrapper_CUDA_mm\)"):
        a.cuda() @ b
    with pytest.raises(RuntimeError, match=CPU_FIRST):
        F.linear(a, b.t().cuda(), torch.zeros(4))  # addmm(bias, input, weight.t()): bias cpu first
    with pytest.raises(RuntimeError, match=MISMATCH):
        torch.bmm(a[None].cuda(), b[None])
    assert_same(a.cuda() @ b.cuda(), a @ b)
    assert_same(F.linear(a.cuda(), b.t().cuda(), torch.ones(4).cuda()), F.linear(a, b.t(), torch.ones(4)))


def test_cat_and_stack_refuse_mixed_devices_even_for_0dim_tensors(fc):
    a = torch.arange(3.0)
    with pytest.raises(RuntimeError, match=MISMATCH + r" \(when checking argument for argument tensors"):
        torch.cat([a.cuda(), a])
    with pytest.raises(RuntimeError, match=MISMATCH):
        torch.stack([torch.tensor(1.0).cuda(), torch.tensor(2.0)])  # no scalar exemption outside TensorIterator
    assert_same(torch.cat([a.cuda(), a.cuda()]), torch.cat([a, a]))
    assert_same(torch.stack([a.cuda(), a.cuda()], 1), torch.stack([a, a], 1))


@pytest.mark.parametrize("op", ["index_select", "gather", "scatter", "scatter_add", "index_add_", "index_copy"])
def test_index_taking_ops_need_the_index_on_the_device(fc, op):
    src, idx = torch.arange(12.0).reshape(3, 4), torch.tensor([[0, 2, 1, 0]])
    calls = {
        "index_select": lambda s, i: s.index_select(1, i[0]),
        "gather": lambda s, i: s.gather(0, i),
        "scatter": lambda s, i: s.scatter(0, i, s[:1] * 10),
        "scatter_add": lambda s, i: s.scatter_add(0, i, s[:1]),
        "index_add_": lambda s, i: s.clone().index_add_(0, i[0, :2], s[:2]),
        "index_copy": lambda s, i: s.index_copy(0, i[0, 1:3], s[:2] * 3),
    }
    call = calls[op]
    with pytest.raises(RuntimeError, match=MISMATCH):
        call(src.cuda(), idx)  # CPU index into a device tensor
    with pytest.raises(RuntimeError, match=CPU_FIRST):
        call(src, idx.cuda())  # device index into a CPU tensor
    assert_same(call(src.cuda(), idx.cuda()), call(src, idx))


def test_a_0dim_cpu_index_is_no_scalar_to_index_select(fc):
    with pytest.raises(RuntimeError, match=MISMATCH):
        torch.arange(4.0, device="cuda").index_select(0, torch.tensor(1))


def test_embedding_needs_ids_on_the_weights_device(fc):
    weight, ids = torch.randn(10, 4), torch.tensor([[3, 1, 3]])
    with pytest.raises(RuntimeError, match=MISMATCH):
        F.embedding(ids, weight.cuda())
    assert_same(F.embedding(ids.cuda(), weight.cuda()), F.embedding(ids, weight))


def test_attention_needs_query_key_value_and_mask_on_one_device(fc):
    q, mask = torch.randn(1, 2, 3, 4), torch.ones(3, 3, dtype=torch.bool).tril()
    with pytest.raises(RuntimeError, match="Expected query, key, and value to have the same device type"):
        F.scaled_dot_product_attention(q.cuda(), q, q.cuda())  # sdp_utils validate_sdpa_input
    with pytest.raises(RuntimeError, match=MISMATCH):
        F.scaled_dot_product_attention(q.cuda(), q.cuda(), q.cuda(), attn_mask=mask)
    assert_same(F.scaled_dot_product_attention(q.cuda(), q.cuda(), q.cuda(), attn_mask=mask.cuda()),
                F.scaled_dot_product_attention(q, q, q, attn_mask=mask))


# --- indexing (TensorAdvancedIndexing.cpp) --------------------------------------------------------------------------

def test_a_cpu_tensor_refuses_device_indices_and_masks(fc):
    table, ids = torch.arange(5.0), torch.tensor([4, 0])
    msg = r"indices should be either on cpu or on the same device as the indexed tensor \(cpu\)"
    with pytest.raises(RuntimeError, match=msg):
        table[ids.cuda()]
    with pytest.raises(RuntimeError, match=msg):
        table[(table > 2).cuda()]


def test_a_device_tensor_takes_cpu_or_device_indices(fc):
    cpu, ids, mask = torch.arange(10.0).reshape(5, 2), torch.tensor([4, 0, 4]), torch.tensor([1, 0, 1, 1, 0]).bool()
    x = cpu.cuda()
    cols = torch.tensor([1, 1, 0])
    for index in (ids, mask, (ids, 1), (slice(None), cols), (None, 2), ..., 3, slice(1, None, 2), [0, 2]):
        assert_same(x[index], cpu[index])
    assert_same(x[ids.cuda()], cpu[ids])
    assert_same(x[mask.cuda()], cpu[mask])
    assert_same(x[:, cols.cuda()], cpu[:, cols])
    assert_same(x[ids.cuda(), cols], cpu[ids, cols])


def test_index_put_rules(fc):
    cpu, ids = torch.zeros(5), torch.tensor([1, 3])
    x = cpu.cuda()
    with pytest.raises(RuntimeError, match=MISMATCH):
        x[ids.cuda()] = torch.tensor([1.0, 2.0])  # a CPU value that is not 0-dim
    with pytest.raises(RuntimeError, match="expected device cuda:0 but got device cpu for value tensor"):
        x.index_put_((ids.cuda(),), torch.tensor([1.0, 2.0]), accumulate=True)
    x[ids] = torch.tensor(7.0)  # a 0-dim CPU value is moved; CPU indices are moved
    x[ids.cuda()] += 1.0
    x[x > 7] = torch.tensor([9.0]).cuda()
    cpu[ids] = 7.0
    cpu[ids] += 1.0
    cpu[cpu > 7] = 9.0
    assert_same(x, cpu)
    x[0] = torch.tensor(5.0)  # a plain element is a copy_, which crosses devices
    x[2:4] = torch.tensor([1.0, 2.0])
    cpu[0], cpu[2:4] = 5.0, torch.tensor([1.0, 2.0])
    assert_same(x, cpu)


def test_device_indices_into_a_cpu_tensor_are_moved_for_index_put(fc):
    # _index_put_impl_ moves the indices to self's device (make_info): allowed on CUDA, at the cost of a read
    table, ids = torch.zeros(4), torch.tensor([2])
    with fc.counting() as c:
        table[ids.cuda()] = 3.0
    assert table.tolist() == [0.0, 0.0, 3.0, 0.0] and c.host_reads == 1


def test_masked_fill_needs_the_mask_on_self_device(fc):
    cpu = torch.arange(4.0)
    with pytest.raises(RuntimeError, match="expected self and mask to be on the same device, but got mask on cpu "
                                           "and self on cuda:0"):
        cpu.cuda().masked_fill(cpu > 1, 0.0)
    assert_same(cpu.cuda().masked_fill(cpu.cuda() > 1, torch.tensor(-1.0)), cpu.masked_fill(cpu > 1, -1.0))


def test_copy_crosses_devices(fc):
    cpu = torch.arange(3.0)
    x = torch.empty(3, device="cuda")
    assert x.copy_(cpu) is x
    assert_same(x, cpu)
    out = torch.empty(3)
    out.copy_(x * 2)
    assert torch.equal(out, cpu * 2)


# --- views and in-place --------------------------------------------------------------------------------------------

def test_writes_through_views_reach_the_base(fc):
    cpu = torch.arange(24.0).reshape(4, 6)
    x = cpu.clone().cuda()
    views = [lambda t: t.view(6, 4)[1], lambda t: t.reshape(24)[3:9], lambda t: t[1:3, ::2],
             lambda t: t.split(2)[1], lambda t: t.unbind(1)[2], lambda t: t.transpose(0, 1)[0],
             lambda t: t.as_strided((2, 2), (6, 1), 1), lambda t: t.narrow(1, 2, 3),
             lambda t: t.t()[2:], lambda t: t.diagonal(), lambda t: t.unsqueeze(0)[0, 3]]
    for i, view in enumerate(views):
        v = view(x)
        assert isinstance(v, FakeCudaTensor) and v._base is not None, i
        assert v.mul_(2) is v  # in place returns the caller's own tensor
        view(cpu).mul_(2)
        assert torch.equal(host(x), cpu), i
    x[0] = -1.0
    cpu[0] = -1.0
    assert_same(x, cpu)
    assert_same(x[:, :1].expand(4, 3) + 1, cpu[:, :1].expand(4, 3) + 1)


def test_in_place_ops_that_change_shape_are_refused(fc):
    x = torch.ones(2, 3, device="cuda")
    with pytest.raises(NotImplementedError, match="shape or strides in place"):
        x.t_()


# --- numpy, generators -----------------------------------------------------------------------------------------------

def test_numpy_of_a_device_tensor_raises(fc):
    x = torch.ones(2, device="cuda")
    msg = "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu()"
    with pytest.raises(TypeError, match=msg):
        x.numpy()
    with pytest.raises(TypeError, match=msg):
        np.asarray(x)
    assert x.cpu().numpy().tolist() == [1.0, 1.0]
    assert x.numpy(force=True).tolist() == [1.0, 1.0]


def test_cuda_generator_reports_the_device(fc):
    g = torch.Generator(device="cuda")
    assert isinstance(g, FakeCudaGenerator) and isinstance(g, torch.Generator)
    assert g.device == torch.device("cuda", 0)
    assert torch.Generator().device == torch.device("cpu")
    assert g.manual_seed(3) is g and g.initial_seed() == 3


@pytest.mark.parametrize("op", ["multinomial", "rand", "randn", "randint", "randperm", "uniform_", "normal_",
                                "exponential_", "bernoulli"])
def test_random_ops_need_a_generator_of_their_device(fc, op):
    probs = torch.softmax(torch.arange(6.0), 0)
    calls = {
        "multinomial": lambda d, g: torch.multinomial(probs.to(d), 2, generator=g),
        "rand": lambda d, g: torch.rand(3, device=d, generator=g),
        "randn": lambda d, g: torch.randn(3, device=d, generator=g),
        "randint": lambda d, g: torch.randint(0, 10, (3,), device=d, generator=g),
        "randperm": lambda d, g: torch.randperm(6, device=d, generator=g),
        "uniform_": lambda d, g: torch.empty(3, device=d).uniform_(generator=g),
        "normal_": lambda d, g: torch.empty(3, device=d).normal_(generator=g),
        "exponential_": lambda d, g: torch.empty(3, device=d).exponential_(generator=g),
        "bernoulli": lambda d, g: torch.bernoulli(probs.to(d), generator=g),
    }
    call = calls[op]
    with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator but found 'cpu'"):
        call("cuda", torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator but found 'cuda'"):
        call("cpu", torch.Generator("cuda").manual_seed(0))
    # the fake generator is a CPU one underneath: same seed, same draws as the CPU op
    assert_same(call("cuda", torch.Generator("cuda").manual_seed(5)), call("cpu", torch.Generator().manual_seed(5)))


def test_device_random_stream_is_separate_and_seeded_by_manual_seed(fc):
    torch.manual_seed(0)
    on_device = torch.rand(3, device="cuda")
    cpu_after = torch.rand(3)
    torch.manual_seed(0)
    cpu_only = torch.rand(3)
    assert torch.equal(cpu_after, cpu_only)  # the device draw did not advance the CPU stream
    assert torch.equal(host(on_device), cpu_only)  # same seed, same (mt19937) draws
    torch.cuda.manual_seed(0)
    assert_same(torch.multinomial(torch.ones(4, device="cuda"), 2), torch.multinomial(torch.ones(4), 2,
                                                                                      generator=torch.Generator()
                                                                                      .manual_seed(0)))


# --- the operators the router uses, in its dtypes ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_router_float_ops_match_the_cpu_bit_for_bit(fc, dtype):
    torch.manual_seed(1)
    h, w, emb = torch.randn(5, 16, dtype=dtype), torch.randn(8, 16, dtype=dtype), torch.randn(20, 16, dtype=dtype)
    ids = torch.tensor([3, 7, 7, 1, 19])
    q = torch.randn(1, 2, 5, 8, dtype=dtype)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    cases = {
        "embedding": lambda d: F.embedding(ids.to(d), emb.to(d)),
        "linear": lambda d: F.linear(h.to(d), w.to(d)),
        "softmax": lambda d: F.softmax(F.linear(h.to(d), w.to(d)).float(), dim=-1),
        "topk": lambda d: torch.topk(F.linear(h.to(d), w.to(d)), 3, dim=-1),
        "argmax": lambda d: F.linear(h.to(d), w.to(d)).argmax(-1),
        "sort": lambda d: torch.sort(F.linear(h.to(d), w.to(d)), dim=-1, stable=True),
        "sdpa": lambda d: F.scaled_dot_product_attention(q.to(d), q.to(d), q.to(d), attn_mask=mask.to(d)),
        "sdpa_causal": lambda d: F.scaled_dot_product_attention(q.to(d), q.to(d), q.to(d), is_causal=True),
        "rms_norm": lambda d: F.rms_norm(h.to(d), (16,), eps=1e-6),
        "layer_norm": lambda d: F.layer_norm(h.to(d), (16,)),
        "silu_mul": lambda d: F.silu(h.to(d)) * h.to(d),
    }
    with torch.inference_mode():
        for name, case in cases.items():
            fake, cpu = case("cuda"), case("cpu")
            for f, c in zip(*(((fake,), (cpu,)) if isinstance(cpu, torch.Tensor) else (fake, cpu))):
                assert torch.equal(host(f), c), name


def test_router_integer_ops_match_the_cpu(fc):
    expert = torch.tensor([2, 0, 2, 1, 2, 0, 3])
    x = expert.cuda()
    sorted_fake, order_fake = torch.sort(x, stable=True)
    sorted_cpu, order_cpu = torch.sort(expert, stable=True)
    assert_same(sorted_fake, sorted_cpu)
    assert_same(order_fake, order_cpu)
    for fake, cpu in zip(torch.unique_consecutive(sorted_fake, return_counts=True),
                         torch.unique_consecutive(sorted_cpu, return_counts=True)):
        assert_same(fake, cpu)
    assert_same(torch.bincount(x, minlength=5), torch.bincount(expert, minlength=5))
    counts = torch.bincount(expert, minlength=4)
    assert_same(torch.repeat_interleave(counts.cuda()), torch.repeat_interleave(counts))
    assert_same(torch.repeat_interleave(torch.arange(4).cuda(), counts.cuda(), output_size=7),
                torch.repeat_interleave(torch.arange(4), counts, output_size=7))
    assert_same(torch.nonzero(x == 2), torch.nonzero(expert == 2))
    assert_same(torch.cumsum(x, 0), torch.cumsum(expert, 0))
    assert_same((x == 2) & (x > 0), (expert == 2) & (expert > 0))
    assert_same(x.to(torch.int32).long(), expert)


# --- the device bugs of design.md section 5, as tiny snippets -------------------------------------------------------

def cpu_mask_indexed_by_device_ids(device: str) -> torch.Tensor:
    alive = torch.tensor([True, False, True, True])  # host-side bookkeeping
    expert_ids = torch.tensor([0, 2, 3], device=device)  # from top-k on the device
    return alive[expert_ids]


def cpu_tensor_plus_device_tensor(device: str) -> torch.Tensor:
    bias = torch.zeros(4)  # forgot device=
    return torch.ones(4, device=device) + bias


def numpy_of_device_tensor(device: str) -> object:
    return torch.softmax(torch.ones(4, device=device), 0).numpy()


def cpu_generator_for_device_sampling(device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)  # forgot device=
    return torch.multinomial(torch.ones(4, device=device), 1, generator=gen)


@pytest.mark.parametrize("snippet, error", [
    (cpu_mask_indexed_by_device_ids, r"indices should be either on cpu or on the same device"),
    (cpu_tensor_plus_device_tensor, MISMATCH),
    (numpy_of_device_tensor, "can't convert cuda:0 device type tensor to numpy"),
    (cpu_generator_for_device_sampling, "Expected a 'cuda' device type for generator but found 'cpu'"),
])
def test_design_doc_device_bugs_raise_under_the_double_and_pass_on_cpu(snippet, error):
    snippet("cpu")  # what CI without the double sees: nothing wrong
    with fake_cuda(), pytest.raises((RuntimeError, TypeError), match=error):
        snippet("cuda")


# --- the rule table itself ----------------------------------------------------------------------------------------

def test_rule_table_reads_native_functions_yaml():
    assert rule_for(aten.add.Tensor).kind is Kind.ITER  # device_check: NoCheck   # TensorIterator
    assert rule_for(aten.eq.Tensor).kind is Kind.ITER
    assert rule_for(aten.index_select.default).kind is Kind.EXACT  # default device_check: ExactSame
    assert rule_for(aten.index_select.default).method == "wrapper_CUDA__index_select"
    assert rule_for(aten.mm.default).method == "wrapper_CUDA_mm"  # structured: as CUDA names it
    assert rule_for(aten.cat.default).kind is Kind.EXACT
    assert rule_for(aten.view.default).kind is Kind.FREE  # device_check: NoCheck
    assert rule_for(aten.index.Tensor).kind is Kind.INDEX
    assert rule_for(aten.copy_.default).kind is Kind.FREE
