"""GPU checks of the dtype and device work, Ray-free (the GPU machine has no Ray): the reference decoder in bf16 on
CUDA against the CPU reference and `transformers`, the expert computation on CUDA, the wire format with CUDA-side
tensors, pinned staging, and the router's dispatch with its hidden states on CUDA (one synchronisation per layer).
Run with `ops/gpu_check.sh` (pytest -m gpu tests/gpu); everything skips cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda:0")
# bf16/fp16 results of different kernels (CUDA vs CPU, fused vs not) agree to the dtype's rounding, not bit for bit.
TOL = {torch.bfloat16: 0.1, torch.float16: 0.01, torch.float32: 1e-4}


@pytest.fixture(autouse=True)
def _no_tf32():
    """float32 matmuls in full float32 (TF32 would break the 1e-4 comparisons)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _reference_on(model_dir, dtype: torch.dtype, device: torch.device):
    """The in-process reference with its weights on `device` (the decoder makes its tensors where its weights are)."""
    from expertmesh.experts.checkpoint import CheckpointReader
    from expertmesh.experts.modeling import MoEDecoder
    from expertmesh.experts.reference import LocalExperts, all_shards
    from expertmesh.experts.weights import load_dense_weights, load_expert_shards

    reader = CheckpointReader(model_dir)
    dense = load_dense_weights(reader, dtype, device=device)
    experts = LocalExperts(load_expert_shards(reader, all_shards(reader), dtype, device), reader.config.hidden_act)
    return MoEDecoder(reader.config, dense, experts)


def _greedy(model, prompt: list[int], steps: int, device: torch.device) -> list[int]:
    cache, step, out = model.new_cache(), torch.tensor(prompt, device=device), []
    for _ in range(steps):
        nxt = int(model.forward([step], [cache])[0][-1].argmax())
        out.append(nxt)
        step = torch.tensor([nxt], device=device)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_decoder_on_cuda_against_cpu_reference_and_transformers(checkpoints, dtype):
    transformers = pytest.importorskip("transformers")
    path = checkpoints["mixtral"]
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    on_cuda = _reference_on(path, dtype, CUDA)
    assert on_cuda.w.embed.device == CUDA and on_cuda.dtype == dtype
    got = on_cuda.forward([torch.tensor(ids, device=CUDA)])[0].float().cpu()
    on_cpu = _reference_on(path, dtype, torch.device("cpu")).forward([torch.tensor(ids)])[0].float()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(CUDA).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids], device=CUDA)).logits[0].float().cpu()
        hf_greedy = hf.generate(torch.tensor([ids[:6]], device=CUDA), max_new_tokens=6, do_sample=False,
                                pad_token_id=0)[0, 6:].tolist()
    assert (got - on_cpu).abs().max().item() <= TOL[dtype]
    assert (got - want).abs().max().item() <= TOL[dtype]
    assert _greedy(on_cuda, ids[:6], 6, CUDA) == hf_greedy
    # Same device, same dtype, same op order: a second run is bit-identical (no nondeterministic kernels).
    again = on_cuda.forward([torch.tensor(ids, device=CUDA)])[0].float().cpu()
    assert torch.equal(got, again)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gated_mlp_on_cuda(dtype):
    from expertmesh.experts.ffn import GatedMLPWeights, activation, gated_mlp

    gen = torch.Generator().manual_seed(0)
    weights = GatedMLPWeights.from_parts(torch.randn(96, 64, generator=gen) * 0.2,
                                         torch.randn(96, 64, generator=gen) * 0.2,
                                         torch.randn(64, 96, generator=gen) * 0.2)
    x = torch.randn(37, 64, generator=gen)  # [T, H]
    act = activation("silu")
    want = gated_mlp(x, weights, act)  # float32 on the CPU
    got = gated_mlp(x.to(CUDA, dtype), weights.to(CUDA, dtype), act)
    assert got.device == CUDA and got.dtype == dtype
    assert (got.float().cpu() - want).abs().max().item() <= TOL[dtype] * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_wire_format_with_cuda_tensors(dtype):
    try:  # protobuf missing, or older than the committed generated code needs: skip, not error
        from expertmesh.experts import wire
        from expertmesh.protos import expert_transport_pb2 as pb
    except Exception as exc:  # noqa: BLE001 - ImportError or protobuf's VersionError
        pytest.skip(f"the wire test needs protobuf >= the generated code's version: {exc}")

    x = (torch.randn(33, 64, device=CUDA) * 50).to(dtype)
    x[0, 0], x[0, 1] = float("nan"), float("-inf")
    msg = pb.Tensor.FromString(wire.encode(x).SerializeToString())  # encoded straight from the device tensor
    y = wire.decode(msg, device=CUDA)
    assert y.device == CUDA and y.dtype == dtype
    assert torch.equal(x.view(torch.int16 if x.element_size() == 2 else torch.int32),
                       y.view(torch.int16 if y.element_size() == 2 else torch.int32))  # bits, NaN included


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pinned_staging_round_trip_with_one_wait(dtype):
    from expertmesh.experts.arrays import HostStager, pack, to_tensor

    waits: list[torch.device] = []

    def synchronize(device: torch.device) -> None:
        waits.append(device)
        torch.cuda.synchronize(device)

    stager = HostStager(synchronize=synchronize)
    rows = [torch.randn(n, 64, device=CUDA).to(dtype) for n in (5, 17, 1, 0)]
    staged = [stager.stage(r) for r in rows]
    stager.finish()
    assert len(waits) == 1 and stager.copies == 4  # one wait for the whole batch
    assert all(s.device.type == "cpu" and s.is_pinned() for s in staged)
    for r, s in zip(rows, staged):
        back = to_tensor(pack(s)).to(CUDA, non_blocking=True)  # what an actor does with what it receives
        assert torch.equal(back, r)


def test_dispatch_with_hidden_states_on_cuda_syncs_once_per_layer(monkeypatch):
    """The router's RemoteExperts with its hidden states on CUDA (a Ray-free transport computing the experts on the
    CPU, as an actor would): rows leave through one wait per layer, the combine runs on CUDA, and the result equals
    the same dispatch from CPU hidden states."""
    from expertmesh.cluster.routing_table import RoutingTable
    from expertmesh.experts.gating import route
    from expertmesh.router_service.dispatch import RemoteExperts
    from tests.fakes import HIDDEN, FakeTransport, expert_weights

    shards = expert_weights(layers=2, experts=4)
    table = RoutingTable.from_actor_shards({f"a{e}": [(layer, e) for layer in range(2)] for e in range(4)})
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(24, HIDDEN, generator=gen)  # [T, H]
    routing = route(torch.randn(24, 4, generator=gen), top_k=2, renormalize=True)
    waits = []
    real = torch.cuda.synchronize
    # Patched before the dispatchers exist: their stagers take the wait function when they are made.
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: (waits.append(device), real(device)))
    on_cpu = RemoteExperts(table, FakeTransport(table, shards))
    on_cuda = RemoteExperts(table, FakeTransport(table, shards))
    cuda_routing = type(routing)(**{k: (v.to(CUDA) if isinstance(v, torch.Tensor) else v)
                                    for k, v in vars(routing).items()})
    for layer in range(2):
        got = on_cuda.run(layer, hidden.to(CUDA), cuda_routing)
        assert got.device == CUDA
        assert torch.allclose(got.cpu(), on_cpu.run(layer, hidden, routing), atol=1e-6, rtol=0)
    assert len(waits) == 2 and on_cuda.stager.syncs == 2 and on_cuda.stager.copies == 8
