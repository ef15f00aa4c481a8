"""The pure/Ray line: the model math, the policies and the planning import no Ray, gRPC or OpenTelemetry, so they run
(and are tested) where those are missing, e.g. the GPU machine, which has no Ray (design notes §5).

Each module is imported in a fresh interpreter and checked on its own: one subprocess imports the modules one after
another and, after each, looks for a forbidden package in sys.modules. A module that pulls one in is reported and the
subprocess stops there (that package is loaded now, so later modules could not be checked); the modules after it are
checked in a new subprocess. A module on the list that does not exist fails too, so a rename cannot silently drop it
from the check: rename it here as well.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FORBIDDEN = ("ray", "grpc", "opentelemetry")
# The configuration layer is lighter still: the CLI reads and checks a configuration (and answers --help) before it
# imports the data plane, so these modules import no torch either (tests/unit/test_cli_imports.py runs the CLI).
CONFIG_FORBIDDEN = (*FORBIDDEN, "torch")

CONFIG_MODULES = (
    "expertmesh.router_service.config",  # the tree: model, ray, experts, router and server sections
    "expertmesh.router_service.config_tree",
    "expertmesh.router_service.batching_config",  # router.batcher
    "expertmesh.router_service.failover_config",  # failover, failover.shed
    "expertmesh.router_service.observability_config",  # observability.metrics
    "expertmesh.router_service.server_checks",
    "expertmesh.router_service.transports.base",  # the transport names
    "expertmesh.cluster.controller_config",  # controller
    "expertmesh.cluster.elastic_config",  # controller.elastic, its autoscale dict
    "expertmesh.cluster.load_stats_config",  # observability.load
    "expertmesh.experts.devices",  # devices
    "expertmesh.experts.embedded_model",
    "expertmesh.experts.errors",
    "expertmesh.experts.repo_ids",  # model.path: folder or Hub repo id
    "expertmesh.experts.setting_choices",  # the names string settings may take
    "expertmesh.experts.tracing_config",  # tracing
    "expertmesh.ops.cli",  # the parser of every command
    "expertmesh.ops.commands.mesh_flags",
    "expertmesh.ops.commands.bench",
    "expertmesh.ops.commands.drill",
    "expertmesh.ops.commands.generate",
    "expertmesh.ops.commands.plan",
    "expertmesh.ops.commands.plan_cluster",
    "expertmesh.ops.commands.score",
    "expertmesh.ops.commands.serve",
    "expertmesh.ops.commands.status",
)

# (The configuration modules, CONFIG_MODULES above, are pure too and checked there, with torch forbidden as well.)
PURE_MODULES = (
    # model math and checkpoints
    "expertmesh.experts.arrays",
    "expertmesh.experts.attention",
    "expertmesh.experts.attention_core",
    "expertmesh.experts.block_allocator",  # which KV-cache blocks are free, shared or cached (no tensors)
    "expertmesh.experts.checkpoint",
    "expertmesh.experts.config",
    "expertmesh.experts.config_deepseek",
    "expertmesh.experts.dense_weights",  # the router's weight dataclasses, shared by the family loaders
    "expertmesh.experts.dtypes",  # model.dtype resolution ("auto" against the checkpoint and the device)
    "expertmesh.experts.ffn",
    "expertmesh.experts.fp8",
    "expertmesh.experts.gating",
    "expertmesh.experts.grouped_ffn",  # a call's experts in grouped matmuls (actors and reference)
    "expertmesh.experts.hub_fetch",  # range reads of Hub files into the node's piece cache (huggingface_hub on use)
    "expertmesh.experts.hub_ranges",  # which bytes of a safetensors file, in which requests
    "expertmesh.experts.hub_reader",  # the checkpoint reader over a Hub repo that fetches what it reads
    "expertmesh.experts.kv_cache",
    "expertmesh.experts.load_progress",  # actors' load progress records (the KV store passed in)
    "expertmesh.experts.mla_attention",
    "expertmesh.experts.dsa_indexer",
    "expertmesh.experts.model_source",  # folders and Hub repo ids (huggingface_hub imported on use)
    "expertmesh.experts.modeling",
    "expertmesh.experts.eviction",  # eviction orders of the expert tier: lru, lfru, arc, layer-cycle (fake clock)
    "expertmesh.experts.eviction_sim",  # replaying a routing trace through the orders and the prefetch decision
    "expertmesh.experts.mxfp4",
    "expertmesh.experts.prefix_cache",  # the prefix cache's hash chain over token ids (no tensors)
    "expertmesh.experts.norms",
    "expertmesh.experts.quant",  # int8/int4 expert weights and their packed matmuls (experts.quant)
    "expertmesh.experts.reference",
    "expertmesh.experts.residency_policy",  # which expert shards stay in an actor's device tier (fake clock)
    "expertmesh.experts.rope",
    "expertmesh.experts.rope_yarn",
    "expertmesh.experts.routed_rows",  # rows sorted by expert, and the one combine order
    "expertmesh.experts.tier_store",  # an actor's memory tiers: loads, prefetch thread, counters
    "expertmesh.experts.tokenizer",
    "expertmesh.experts.weights",
    "expertmesh.experts.weights_deepseek",
    "expertmesh.experts.wire",  # the expert call's wire format (protobuf messages, no gRPC)
    # router: dispatch planning/combine, the dispatcher, sampling, batching, request handling, the transport interface
    "expertmesh.router_service.proto_mapping",
    "expertmesh.router_service.admin_auth",  # who may call the destructive Admin RPCs
    "expertmesh.router_service.batching",
    "expertmesh.router_service.chat_template",  # chat templates (jinja2), as transformers renders them
    "expertmesh.router_service.continuation",  # what the gRPC front re-sends when a router replica dies
    "expertmesh.router_service.call_retry",  # where a failed expert call's rows go; a layer's retry rounds
    "expertmesh.router_service.dispatch",
    "expertmesh.router_service.dispatch_plan",
    "expertmesh.router_service.error_log",  # how a replica logs refused requests (standard logging only)
    "expertmesh.router_service.errors",
    "expertmesh.router_service.log_limit",
    "expertmesh.router_service.pending_layers",  # a layer's round between submit and wait; the rounds still out
    "expertmesh.router_service.replica_health",  # dead actors, breakers, reviver: which replicas take a call
    "expertmesh.router_service.openai_api",  # OpenAI HTTP bodies, responses, stream chunks, errors
    "expertmesh.router_service.pool_layout",  # which pool to start (the live nodes from Ray only on call)
    "expertmesh.router_service.prefetch",  # predicting the next MoE layer's experts (pre-gating, history)
    "expertmesh.router_service.prefetch_policy",  # which predictions become prefetch hints
    "expertmesh.router_service.affinity",  # expert-affinity admission (fairness bound)
    "expertmesh.router_service.affinity_sim",  # FIFO vs affinity admission replayed on a routing trace
    "expertmesh.router_service.openai_requests",  # OpenAI jobs -> GenerationRequests, batcher events -> dicts
    "expertmesh.router_service.openai_responses",  # events -> OpenAI response bodies and stream chunks
    "expertmesh.router_service.choice_streams",  # a request's choice streams merged into one
    "expertmesh.router_service.http_metrics",  # /metrics: Prometheus text of the front and the router
    "expertmesh.router_service.sampling",
    "expertmesh.router_service.step_profile",  # the stage clocks of a served step
    "expertmesh.router_service.shedding",  # overload shedding policy (fake clock in tests)
    "expertmesh.router_service.table_switch",  # live remap: the table a step uses, switched between steps
    "expertmesh.router_service.transports",
    # cluster policies and plans
    "expertmesh.cluster.memory_plan",  # GPU memory accounting for placement and plan-cluster
    "expertmesh.cluster.cost_profiles",  # the latency model: hardware, transports, model shapes
    "expertmesh.cluster.cost_model",  # per-layer decode latency and the overlap choice
    "expertmesh.cluster.cost_calibration",  # the CPU profile fitted from bench dispatch JSON
    "expertmesh.cluster.cost_report",  # prediction tables, published anchors, targets
    # bench serve --peer: workloads, schedule and summaries; the neutral client; the transformers serve launcher
    "expertmesh.ops.bench.peer_plan",
    "expertmesh.ops.bench.openai_load",
    "expertmesh.ops.bench.peer_server",
    "expertmesh.cluster.overlap_policy",  # router.overlap auto, per step
    "expertmesh.cluster.actor_slots",
    "expertmesh.cluster.autoscale",
    "expertmesh.cluster.default_pool",  # the default expert pool's actors and slots (nodes passed in)
    "expertmesh.cluster.breaker",
    "expertmesh.cluster.elastic",
    "expertmesh.cluster.lost_restore",  # re-planning lost actors onto survivors without spare capacity
    "expertmesh.cluster.fleet_failures",  # the fleet simulator: published failure rates
    "expertmesh.cluster.fleet_model",  # restore times from the drill reports
    "expertmesh.cluster.fleet_trace",  # drifting routing-load traces
    "expertmesh.cluster.fleet_metrics",
    "expertmesh.cluster.fleet_config",
    "expertmesh.cluster.fleet_sim",  # the event loop over the real policies (torch only when shedding runs)
    "expertmesh.cluster.eplb_greedy",
    "expertmesh.cluster.load_stats",
    "expertmesh.cluster.naming",
    "expertmesh.cluster.mesh_store",  # imports Ray only inside its calls
    "expertmesh.cluster.placement_actors",
    "expertmesh.cluster.planner",
    "expertmesh.cluster.pool_spec",
    "expertmesh.cluster.router_gpus",  # the GPUs kept for router replicas (start-up, controller, plan-cluster)
    "expertmesh.cluster.routing_table",
    "expertmesh.cluster.shard_placement",
    "expertmesh.cluster.shard_liveness",  # the last-live-replica guard and the health verdict
    # the controller's state objects and flows (the Ray actor, cluster/controller.py, is a shell over them)
    "expertmesh.cluster.activity_log",
    "expertmesh.cluster.admin_checks",  # refusals of kill/drain/undrain
    "expertmesh.cluster.control_pass",  # one elastic control pass on the controller's state
    "expertmesh.cluster.controller_record",  # the persisted record (Ray only inside load/save, via MeshStore)
    "expertmesh.cluster.displacement",  # displaced actors and their stand-ins
    "expertmesh.cluster.node_choice",
    "expertmesh.cluster.node_loss",  # which nodes died and which actors were on them, from node-table snapshots
    "expertmesh.cluster.controller_placement",
    "expertmesh.cluster.placement_change",
    "expertmesh.cluster.placement_claims",  # placements planned but not yet in Ray's free table
    "expertmesh.cluster.remap_flow",  # the live remap's steps, Ray reached through an ops object
    "expertmesh.cluster.replica_registry",
    "expertmesh.cluster.restore_flow",  # the watch and restores, Ray reached through an ops object
    "expertmesh.cluster.router_reports",
    # ops: helpers, the drill's configuration, record, pure report and rendering, the CLI's flag table
    "expertmesh.ops.train.corpus",
    "expertmesh.ops.drill",
    "expertmesh.ops.drill.config",
    "expertmesh.ops.drill.record",
    "expertmesh.ops.drill.render",
    "expertmesh.ops.drill.report",
    "expertmesh.ops.load_report",
    "expertmesh.ops.measure",
    "expertmesh.ops.perplexity",  # held_out_perplexity: benchmarks and drills score with it
    "expertmesh.ops.plan_cli",
    "expertmesh.ops.bench",
    "expertmesh.ops.bench.checkpoints",  # synthetic checkpoints: benchmarks and tests write them
    "expertmesh.ops.bench.common",  # machine information, timing, the JSON report
    "expertmesh.ops.bench.serve_profile",  # bench serve's step-profile table and eta_serve
    "expertmesh.ops.bench.dispatch_report",  # report assembly: checked at unit level (test_bench_reports.py)
    "expertmesh.ops.bench.offload_report",
    "expertmesh.ops.bench.serve_report",
    "expertmesh.ops.train",
)

# Runs in the fresh interpreter. argv[1]: JSON list of modules, argv[2]: JSON list of FORBIDDEN. Prints one JSON
# object: module -> a list of the forbidden packages it loaded, or {"missing": ...} / {"error": ...}; modules after
# an impure one are left out.
_PROBE = r"""
import importlib, importlib.util, json, sys
forbidden = json.loads(sys.argv[2])

def loaded():
    return sorted({name.split(".")[0] for name in sys.modules} & set(forbidden))

report = {"<interpreter start>": loaded()}
for name in json.loads(sys.argv[1]):
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if not found:
        report[name] = {"missing": name}
        continue
    try:
        importlib.import_module(name)
    except Exception as exc:
        report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        if loaded():
            break
        continue
    report[name] = loaded()
    if report[name]:
        break
print(json.dumps(report))
"""


def probe(modules: list[str], forbidden: tuple[str, ...] = FORBIDDEN) -> dict:
    """module -> what importing it loaded of `forbidden` (or why it could not be imported), each module checked in
    an interpreter where no forbidden package was loaded yet."""
    report: dict = {}
    remaining = list(modules)
    while remaining:
        result = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(remaining), json.dumps(forbidden)],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        step = json.loads(result.stdout.strip().splitlines()[-1])
        start = step.pop("<interpreter start>")
        assert start == [], f"the interpreter loads {start} before importing anything (sitecustomize? a .pth file?)"
        assert step, f"the probe checked none of {remaining}"
        report.update(step)
        remaining = remaining[len(step):]
    return report


@pytest.fixture(scope="module")
def report() -> dict:
    return probe(list(PURE_MODULES))


@pytest.mark.parametrize("module", PURE_MODULES)
def test_module_imports_no_ray_grpc_or_opentelemetry(report, module):
    assert report[module] == [], f"importing {module} loads {report[module]}"


@pytest.fixture(scope="module")
def config_report() -> dict:
    return probe(list(CONFIG_MODULES), CONFIG_FORBIDDEN)


@pytest.mark.parametrize("module", CONFIG_MODULES)
def test_config_module_imports_no_torch_ray_grpc_or_opentelemetry(config_report, module):
    assert config_report[module] == [], f"importing {module} loads {config_report[module]}"


def test_the_list_names_each_module_once():
    assert len(set(PURE_MODULES)) == len(PURE_MODULES)
    assert len(set(CONFIG_MODULES)) == len(CONFIG_MODULES)
    assert not set(PURE_MODULES) & set(CONFIG_MODULES)  # a configuration module is checked on the stricter list


def test_the_probe_catches_an_impure_module_and_checks_the_rest_afresh():
    # The controller is a Ray actor module; the modules after it must still be checked, each in a clean interpreter.
    modules = ["expertmesh.cluster.naming", "expertmesh.cluster.controller", "expertmesh.cluster.breaker",
               "expertmesh.router_service.transports.grpc", "expertmesh.cluster.no_such_module"]
    got = probe(modules)
    assert got["expertmesh.cluster.naming"] == []
    assert "ray" in got["expertmesh.cluster.controller"]
    assert got["expertmesh.cluster.breaker"] == []
    assert {"ray", "grpc"} <= set(got["expertmesh.router_service.transports.grpc"])
    assert got["expertmesh.cluster.no_such_module"] == {"missing": "expertmesh.cluster.no_such_module"}
