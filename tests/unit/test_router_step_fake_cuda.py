"""The router's whole step on a (fake) GPU: every family, prefill, decode, chunked steps, seeded sampling, a resumed
stream, degrade around a dead replica, shedding, a capacity factor, the overlap schedule and affinity admission's
prompt signature, under the fake-CUDA
double (ops/fake_cuda/__init__.py), which raises wherever CUDA would on mixed devices and counts every device read.

Each run must equal the same router on the CPU bit for bit (the double computes on the CPU underneath), and a decode
step must read the device once per MoE layer (the routing's crossing, experts/device_rule.py) and nowhere else.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from expertmesh.ops.fake_cuda import fake_cuda
from expertmesh.router_service.dispatch import FailoverConfig
from tests.router_step import (
    EAGER_SHED,
    StepSetup,
    build_router,
    prefill_then_decode,
    prompts,
    resumed,
    serve,
    serving_requests,
)
from tests.router_step_cuda import FAMILIES

# On the fake device: a small KV pool (the default would take 90 % of the fake 80 GiB), actors on the host (their
# reads are the actors', in other processes, not the router's).
FAKE = dict(kv_cache_gb=0.01, actor_device="cpu", observe=True)


@pytest.fixture
def models(router_step_checkpoints) -> dict[str, Path]:
    return router_step_checkpoints


def _both(model_dir: Path, run, **setup):
    """run(model, backend) on the CPU router and on the fake-CUDA one -> (cpu result, fake result, fc)."""
    cpu = run(*build_router(model_dir, "cpu", torch.float32, StepSetup(**setup)))
    with fake_cuda() as fc:
        fake = run(*build_router(model_dir, "cuda", torch.float32, StepSetup(**setup, **FAKE)))
    return cpu, fake, fc


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


@pytest.mark.parametrize("family", ["mixtral", "many_experts"])  # the piece loop and the rank-pass combine
@pytest.mark.parametrize("overlap", [False, True])
def test_device_rows_stay_on_the_device_with_one_read_per_moe_layer(models, family, overlap):
    """A transport that sends device rows (`rdt`): dispatch brings only the routing to the host, gathers each
    call's rows on the device, and combines outputs read back onto the device, with no read beyond the routing's
    and the same logits as the CPU router."""
    model_dir = models[family]
    cpu_model, _ = build_router(model_dir, "cpu", torch.float32, StepSetup(overlap=overlap))
    ids = prompts(cpu_model.cfg.vocab_size)
    want = prefill_then_decode(cpu_model, ids)
    # The in-process actors compute on the router's device here: rows and outputs never leave it.
    setup = StepSetup(kv_cache_gb=0.01, observe=True, device_rows=True, overlap=overlap)
    with fake_cuda() as fc:
        model, backend = build_router(model_dir, "cuda", torch.float32, setup)
        got = prefill_then_decode(model, ids)
        caches = [model.new_cache() for _ in ids]
        model.forward([torch.tensor(p) for p in ids], caches, logits="last")
        with fc.counting() as decode:
            model.forward([torch.tensor([1]) for _ in ids], caches, logits="last")
        transport = backend.transport
        assert transport.calls > 0 and transport.device_row_calls == transport.calls  # every call took device rows
    assert _equal(got, want)
    moe_layers = len(model.cfg.moe_layers)
    waits = moe_layers * (2 if overlap else 1)  # each micro-batch's round crosses once
    assert decode.syncs == waits, decode.sync_sites
    assert decode.host_reads == 0, decode.read_sites
    assert decode.shape_syncs == 0, decode.shape_sync_sites


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_on_the_device_equal_the_cpu_router_with_one_read_per_moe_layer(models, family):
    model_dir = models[family]
    cpu_model, _ = build_router(model_dir, "cpu", torch.float32)
    ids = prompts(cpu_model.cfg.vocab_size)
    want = prefill_then_decode(cpu_model, ids)
    with fake_cuda() as fc:
        model, backend = build_router(model_dir, "cuda", torch.float32, StepSetup(**FAKE))
        assert model.device.type == "cuda" and model.kv_pool.device.type == "cuda"
        got = prefill_then_decode(model, ids)
        caches = [model.new_cache() for _ in ids]
        model.forward([torch.tensor(p) for p in ids], caches, logits="last")
        with fc.counting() as decode:
            logits = model.forward([torch.tensor([1]) for _ in ids], caches, logits="last")
        assert all(x.device.type == "cuda" for x in logits)
    assert _equal(got, want)
    snapshot = backend.observer.snapshot()  # load statistics were kept from the device's routings
    assert sum(snapshot["counts"]["shard_load"][0]) > 0
    moe_layers = len(model.cfg.moe_layers)
    # One wait per MoE layer (the routing and hidden state come to the host together), no other read of any kind.
    assert decode.syncs == moe_layers, decode.sync_sites
    assert decode.host_reads == 0, decode.read_sites
    assert decode.shape_syncs == 0, decode.shape_sync_sites


def test_many_experts_take_the_rank_pass_combine(models):
    """128 experts, top-8 over 3 prompts: more than 16 pieces per layer, so the combine runs combine_rows."""
    from expertmesh.experts.routed_rows import PIECE_LOOP_MAX

    model, _ = build_router(models["many_experts"], "cpu", torch.float32)
    prefill_then_decode(model, prompts(model.cfg.vocab_size), steps=0)
    routing = next(iter(model.last_trace.routings.values()))
    assert len(torch.unique(routing.experts)) > PIECE_LOOP_MAX


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_served_with_chunked_prefill_and_seeded_sampling_equals_the_cpu_router(models, family):
    def run(model, backend):
        return serve(model, serving_requests(model.cfg.vocab_size))

    cpu, fake, fc = _both(models[family], run)
    assert fake == cpu and all(len(ids) == 5 for ids in fake)


def test_a_step_samples_every_sequence_with_one_read(models):
    with fake_cuda() as fc:
        model, _ = build_router(models["mixtral"], "cuda", torch.float32, StepSetup(**FAKE))
        requests = serving_requests(model.cfg.vocab_size, max_tokens=4)
        with fc.counting() as served:
            serve(model, requests)
    moe_layers = len(model.cfg.moe_layers)
    # Per step: one wait per MoE layer and one read of the step's sampled tokens (router_service/sampling.py).
    sampled = [site for site in served.read_sites if "sampling.py" in site]
    assert sampled and served.shape_syncs == 0, served.shape_sync_sites
    assert served.syncs % moe_layers == 0
    steps = served.syncs // moe_layers
    assert sum(served.read_sites[s] for s in sampled) <= steps
    assert served.host_reads <= steps, served.read_sites


def test_a_resumed_stream_on_the_device_continues_exactly(models):
    with fake_cuda():
        model, _ = build_router(models["mixtral"], "cuda", torch.float32, StepSetup(**FAKE))
        request = serving_requests(model.cfg.vocab_size, max_tokens=6)[1]  # temperature 1, seeded
        whole = serve(model, [request])[0]
        rest = serve(model, [resumed(request, whole[:3])])[0]
    assert rest == whole[3:]


def test_degrade_around_a_dead_replica_on_the_device(models):
    def run(model, backend):
        backend.dead.add("expert-a0")  # every shard of its slice has no live replica
        return prefill_then_decode(model, prompts(model.cfg.vocab_size)), backend.degraded_slots

    for family in ("mixtral", "deepseek_v3"):
        (cpu, cpu_moved), (fake, fake_moved), _ = _both(models[family], run,
                                                        failover=FailoverConfig(no_replica_policy="degrade"))
        assert cpu_moved > 0 and fake_moved == cpu_moved and _equal(fake, cpu), family


def test_overload_shedding_on_the_device(models):
    def run(model, backend):
        return prefill_then_decode(model, prompts(model.cfg.vocab_size)), backend.shed_slots

    (cpu, cpu_shed), (fake, fake_shed), _ = _both(models["mixtral"], run, failover=FailoverConfig(shed=EAGER_SHED))
    assert cpu_shed > 0 and fake_shed == cpu_shed and _equal(fake, cpu)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_a_capacity_factor_on_the_device(models, family):
    def run(model, backend):
        out = prefill_then_decode(model, prompts(model.cfg.vocab_size))
        return out, sum(r.rerouted for r in model.last_trace.routings.values())

    (cpu, _), (fake, _), _ = _both(models[family], run, capacity_factor=0.5)
    assert _equal(fake, cpu)


def test_the_overlap_schedule_on_the_device(models):
    def run(model, backend):
        return prefill_then_decode(model, prompts(model.cfg.vocab_size))

    cpu, fake, _ = _both(models["deepseek_v3"], run, overlap=True)
    assert _equal(fake, cpu)


def test_the_gpu_script_runs_under_the_double_without_ray():
    """tests/router_step_cuda.py, the script for the day a GPU is lent, runs end to end on the fake device in a
    process where Ray and OpenTelemetry cannot be imported (the GPU machine's image has neither)."""
    pytest.importorskip("transformers")
    code = textwrap.dedent("""
        import importlib.abc, sys
        class NoRay(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in ("ray", "opentelemetry"):
                    raise ImportError(f"{name} is not on the GPU machine")
        sys.meta_path.insert(0, NoRay())
        from expertmesh.ops.fake_cuda import fake_cuda
        from tests.router_step_cuda import main
        with fake_cuda(total_memory=2**30):
            sys.exit(main(["--families", "mixtral,gpt_oss", "--gpu-memory-utilization", "0.5"]))
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("PASS") == 2 * 3 + 2 + 1 and "FAIL" not in done.stdout, done.stdout  # + device rows


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_affinity_admissions_prompt_signature_reads_the_device_once_per_prompt(models, family):
    """Affinity admission (router.batcher.admission: affinity) predicts a waiting prompt's experts from its
    embeddings under the first MoE gate: on the device that is one read per prompt (its picks), and the same experts
    as on the CPU."""
    from expertmesh.router_service.affinity_admission import prompt_signature

    cpu_model, _ = build_router(models[family], "cpu", torch.float32)
    ids = prompts(cpu_model.cfg.vocab_size)
    want = [prompt_signature(cpu_model, p, 0) for p in ids]
    with fake_cuda() as fc:
        model, _ = build_router(models[family], "cuda", torch.float32, StepSetup(**FAKE))
        with fc.counting() as counted:
            got = [prompt_signature(model, p, 0) for p in ids]
    assert got == want and all(len(s) > 0 for s in got)
    assert counted.host_reads == len(ids) and counted.syncs == 0 and counted.shape_syncs == 0, counted.read_sites
    assert all("affinity_admission.py" in site for site in counted.read_sites), counted.read_sites
