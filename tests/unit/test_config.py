"""The configuration tree (router_service/config.py) and its command-line flags (ops/commands/mesh_flags.py):
round trips, unknown keys and bad values refused naming the dotted field, every flag mapped to a real field."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from expertmesh.cluster.elastic import ElasticConfig
from expertmesh.ops.cli import build_parser
from expertmesh.ops.commands.mesh_flags import FLAGS, add_mesh_flags, mesh_config_from_args
from expertmesh.router_service.config import ConfigError, MeshConfig
from expertmesh.router_service.config_tree import field_names

CONFIGS = Path(__file__).resolve().parents[2] / "cluster" / "configs"


def parse(*argv: str, defaults: MeshConfig | None = None) -> MeshConfig:
    parser = argparse.ArgumentParser()
    add_mesh_flags(parser)
    return mesh_config_from_args(parser.parse_args(list(argv)), defaults)


def test_defaults_validate_and_round_trip_through_plain_data():
    config = MeshConfig().validate()
    data = config.to_dict()
    assert json.loads(json.dumps(data)) == data  # plain data only (what a YAML file and Serve's args carry)
    assert MeshConfig.from_dict(data) == config
    assert MeshConfig.from_dict({}) == config and MeshConfig.from_dict(None) == config


def test_a_full_tree_round_trips_with_tuples_nested_sections_and_optional_sections():
    config = MeshConfig.from_dict({
        "model": {"name": "m", "dtype": "bfloat16"}, "ray": {"address": "10.0.0.1:6379"},
        "router": {"transport": "grpc", "autoscale": [2, 5], "batcher": {"max_active": 8}},
        "controller": {"elastic": {"slots_per_gpu": 3, "autoscale": {"target_load_per_replica": 100.0}}},
        "observability": {"load": {"window_s": 30.0, "bucket_s": 2.0}, "metrics": {"enabled": False}},
        "tracing": {"exporter": "file", "path": "/tmp/spans.jsonl"},
    }).validate()
    assert config.router.autoscale == (2, 5) and config.router.batcher.max_active == 8
    assert config.controller.elastic == ElasticConfig(slots_per_gpu=3, autoscale={"target_load_per_replica": 100.0})
    assert config.observability.load.window_s == 30.0 and not config.observability.metrics.enabled
    assert MeshConfig.from_dict(yaml.safe_load(yaml.safe_dump(config.to_dict()))) == config
    assert config.router.deployment_options() == {
        "autoscaling_config": {"min_replicas": 2, "max_replicas": 5, "target_ongoing_requests": 32}}


@pytest.mark.parametrize("data, field", [
    ({"modle": {}}, "modle"),
    ({"router": {"transprot": "grpc"}}, "router.transprot"),
    ({"router": {"batcher": {"max_activ": 3}}}, "router.batcher.max_activ"),
    ({"controller": {"elastic": {"slots": 3}}}, "controller.elastic.slots"),
    ({"experts": {"replicas_per_expert": "2"}}, "experts.replicas_per_expert"),
    ({"experts": {"replicas_per_expert": True}}, "experts.replicas_per_expert"),
    ({"router": {"overlap": "yes"}}, "router.overlap"),
    ({"router": {"autoscale": [1]}}, "router.autoscale"),
    ({"router": {"autoscale": [1, "x"]}}, "router.autoscale[1]"),
    ({"router": "grpc"}, "router"),
    ({"model": {"dtype": None}}, "model.dtype"),
])
def test_bad_plain_data_is_refused_naming_the_field(data, field):
    with pytest.raises(ConfigError) as err:
        MeshConfig.from_dict(data)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


@pytest.mark.parametrize("settings, field", [
    ({"model.dtype": "int8"}, "model.dtype"),
    ({"experts.eviction": "mru"}, "experts.eviction"),
    ({"model.path": "/nonexistent"}, "model.path"),
    ({"ray.num_cpus": 0}, "ray.num_cpus"),
    ({"ray.address": "10.0.0.1:6379", "ray.num_cpus": 2}, "ray.num_cpus"),
    ({"experts.replicas_per_expert": 0}, "experts.replicas_per_expert"),
    ({"experts.placement": "/nonexistent.json"}, "experts.placement"),
    ({"experts.quant": "int3"}, "experts.quant"),
    ({"router.transport": "carrier-pigeon"}, "router.transport"),
    ({"router.capacity_factor": float("inf")}, "router.capacity_factor"),
    ({"router.overlap": True, "router.capacity_factor": 1.0}, "router.overlap"),
    ({"router.autoscale": (3, 2)}, "router.autoscale"),
    ({"router.cuda_graphs": "always"}, "router.cuda_graphs"),
    ({"router.cuda_graphs": "on"}, "router.cuda_graphs"),  # a router on the CPU
    ({"router.cuda_graphs": "on", "router.gpus": 1.0, "router.capacity_factor": 1.0}, "router.cuda_graphs"),
    ({"router.cuda_graph_max_batch": 0}, "router.cuda_graph_max_batch"),
    ({"router.batcher.max_waiting": 0}, "router.batcher.max_waiting"),
    ({"router.kv_cache_gb": 0.0}, "router.kv_cache_gb"),
    ({"router.kv_cache_gb": float("nan")}, "router.kv_cache_gb"),
    ({"router.gpu_memory_utilization": 1.5}, "router.gpu_memory_utilization"),
    ({"router.kv_block_size": 0}, "router.kv_block_size"),
    ({"router.prefix_caching": "yes"}, "router.prefix_caching"),
    ({"failover.no_replica_policy": "panic"}, "failover.no_replica_policy"),
    ({"failover.call_timeout_s": 0}, "failover.call_timeout_s"),
    ({"controller.check_interval_s": -1}, "controller.check_interval_s"),
    ({"controller.elastic": {}, "controller.enabled": False}, "controller.enabled"),
    ({"controller.elastic.slots_per_gpu": 0}, "controller.elastic.slots_per_gpu"),
    ({"controller.elastic.autoscale": {"target_load_per_replica": -1.0}},
     "controller.elastic.autoscale.target_load_per_replica"),
    ({"controller.elastic.autoscale": {"target": 1.0}}, "controller.elastic.autoscale"),
    ({"observability.load.bucket_s": 0}, "observability.load.bucket_s"),
    ({"tracing.exporter": "file"}, "tracing.path"),
    ({"server.port": 70000}, "server.port"),
    ({"server.tls_cert": "/nonexistent.pem"}, "server.tls_key"),
    ({"server.auth_token": "  "}, "server.auth_token"),
    ({"server.admin_token": ""}, "server.admin_token"),
    ({"server.auth_token": "same", "server.admin_token": "same"}, "server.admin_token"),
    ({"experts.replicas_per_expert": 2, "controller.elastic": {}}, "experts.replicas_per_expert"),
])
def test_validation_names_the_dotted_field(settings, field):
    with pytest.raises(ConfigError) as err:
        MeshConfig().replace(**settings).validate()
    assert err.value.field == field, err.value


def test_replace_sets_one_field_by_path_and_creates_a_missing_section():
    config = MeshConfig().replace(**{"controller.elastic.slots_per_gpu": 4, "router.batcher.max_active": 2})
    assert config.controller.elastic == ElasticConfig(slots_per_gpu=4)
    assert config.router.batcher.max_active == 2
    assert MeshConfig().router.batcher.max_active == 64  # frozen: the original is untouched
    with pytest.raises(ConfigError, match="^router.batcher.max_activ: unknown setting"):
        MeshConfig().replace(**{"router.batcher.max_activ": 2})


def test_load_reads_yaml_and_json_and_names_a_bad_file(tmp_path):
    data = {"experts": {"replicas_per_expert": 3}, "router": {"transport": "compiled"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "c.json").write_text(json.dumps(data))
    assert MeshConfig.load(tmp_path / "c.yaml") == MeshConfig.load(tmp_path / "c.json") == MeshConfig.from_dict(data)
    (tmp_path / "bad.yaml").write_text("router: [unclosed")
    with pytest.raises(ConfigError, match="^config: .*bad.yaml is not valid yaml"):
        MeshConfig.load(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="^config: cannot read"):
        MeshConfig.load(tmp_path / "missing.json")


def test_the_serve_yaml_and_kuberay_args_are_a_valid_tree():
    serve_args = yaml.safe_load((CONFIGS / "serve_config.yaml").read_text())["applications"][0]["args"]
    config = MeshConfig.from_dict(serve_args).validate()
    assert config.experts.replicas_per_expert == 2 and config.router.autoscale == (1, 4)
    manifest = yaml.safe_load((CONFIGS / "kuberay-rayservice.yaml").read_text())
    kuberay_args = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert MeshConfig.from_dict(kuberay_args) == config


def _leaf_paths(cls: type, prefix: str = "") -> set[str]:
    """Dotted paths of every field in the tree (sections and leaves; dict sections are leaves)."""
    import typing

    paths = set()
    hints = typing.get_type_hints(cls)
    for name in field_names(cls):
        path = f"{prefix}{name}"
        paths.add(path)
        for option in typing.get_args(hints[name]) or (hints[name],):
            if dataclasses.is_dataclass(option):
                paths |= _leaf_paths(option, path + ".")
    return paths


def test_every_flag_sets_a_real_field_and_no_two_flags_set_the_same_one():
    fields = _leaf_paths(MeshConfig)
    autoscale = "controller.elastic.autoscale."
    for flag in FLAGS:
        assert flag.path in fields or flag.path.startswith(autoscale), flag
    paths = [f.path for f in FLAGS]
    assert len(paths) == len(set(paths))
    assert len({f.flag for f in FLAGS}) == len(FLAGS)


def test_flags_override_the_config_file_which_overrides_defaults(tmp_path):
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump({"experts": {"replicas_per_expert": 3}, "router": {"transport": "grpc"},
                                    "failover": {"wait_timeout_s": 5.0}}))
    config = parse("--config", str(path), "--transport", "compiled", "--max-active", "7", "--no-restore")
    assert config.router.transport == "compiled"  # the flag
    assert config.experts.replicas_per_expert == 3 and config.failover.wait_timeout_s == 5.0  # the file
    assert config.router.batcher.max_active == 7 and not config.controller.restore
    assert config.failover.call_timeout_s == MeshConfig().failover.call_timeout_s  # the default
    assert parse() == MeshConfig()
    drill_defaults = MeshConfig().replace(**{"experts.replicas_per_expert": 2})
    assert parse(defaults=drill_defaults) == drill_defaults  # a command's own defaults, when no file is given
    assert parse("--config", str(path), defaults=drill_defaults).experts.replicas_per_expert == 3


def test_expert_quant_flag_reaches_the_pool_spec_field():
    config = parse("--expert-quant", "int4")
    assert config.experts.quant == "int4" and MeshConfig().experts.quant == "none"
    assert MeshConfig.from_dict(config.to_dict()) == config


def test_cuda_graphs_take_auto_on_or_off_from_flags_and_files():
    assert MeshConfig().router.cuda_graphs == "auto" and MeshConfig().router.cuda_graph_max_batch == 256
    config = parse("--cuda-graphs", "on", "--router-gpus", "1", "--cuda-graph-max-batch", "64")
    assert (config.router.cuda_graphs, config.router.cuda_graph_max_batch) == ("on", 64)
    assert MeshConfig.from_dict(config.to_dict()) == config
    assert parse("--cuda-graphs", "off").router.cuda_graphs == "off"
    with pytest.raises(SystemExit):
        parse("--cuda-graphs", "sometimes")


def test_overlap_takes_true_false_or_auto_from_flags_and_files():
    assert parse("--overlap").router.overlap is True  # the bare flag keeps its old meaning
    assert parse("--overlap", "auto").router.overlap == "auto"
    assert parse("--overlap", "off").router.overlap is False and MeshConfig().router.overlap is False
    config = MeshConfig.from_dict({"router": {"overlap": "auto", "capacity_factor": 1.0}})  # auto: off with a cap
    assert MeshConfig.from_dict(config.to_dict()) == config
    with pytest.raises(SystemExit):
        parse("--overlap", "sometimes")


def test_elastic_flags_build_the_elastic_section_and_need_elastic():
    config = parse("--elastic", "--slots-per-gpu", "5", "--autoscale-target", "200", "--max-gpus", "6")
    assert config.controller.elastic == ElasticConfig(slots_per_gpu=5, autoscale={"target_load_per_replica": 200.0,
                                                                                  "max_gpus": 6})
    with pytest.raises(ConfigError, match="^controller.elastic.slots_per_gpu: --slots-per-gpu needs --elastic"):
        parse("--slots-per-gpu", "5")
    with pytest.raises(ConfigError, match="^controller.elastic.autoscale.max_gpus: --max-gpus needs"):
        parse("--elastic", "--max-gpus", "6")


def test_elastic_flag_keeps_a_config_files_elastic_section(tmp_path):
    path = tmp_path / "mesh.json"
    path.write_text(json.dumps({"controller": {"elastic": {"slots_per_gpu": 6}}}))
    assert parse("--config", str(path), "--elastic").controller.elastic.slots_per_gpu == 6


def test_auth_token_comes_from_the_environment_only_when_not_given(monkeypatch):
    monkeypatch.setenv("EXPERTMESH_TOKEN", "from-env")
    assert parse().server.auth_token == "from-env"
    assert parse("--auth-token", "given").server.auth_token == "given"


def test_admin_token_comes_from_its_own_environment_variable_only_when_not_given(monkeypatch):
    monkeypatch.delenv("EXPERTMESH_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("EXPERTMESH_TOKEN", raising=False)
    assert parse().server.admin_token is None  # default: destructive Admin calls are refused
    monkeypatch.setenv("EXPERTMESH_ADMIN_TOKEN", "admin-from-env")
    assert parse().server.admin_token == "admin-from-env"
    assert parse("--admin-token", "given").server.admin_token == "given"
    assert parse().server.auth_token is None  # the bearer token does not follow from it


def test_flag_values_are_checked_by_the_tree_naming_the_field():
    with pytest.raises(ConfigError, match="^router.batcher.max_active: must be ≥ 1"):
        parse("--max-active", "0")
    with pytest.raises(ConfigError, match="^server.port:"):
        parse("--port", "99999")


def test_every_command_parses_its_documented_invocation():
    parser = build_parser()
    assert parser.parse_args(["serve", "--port", "0", "--transport", "grpc"]).command == "serve"
    assert parser.parse_args(["generate", "--local", "--prompt", "x", "--replicas-per-expert", "2"]).local
    assert parser.parse_args(["score", "--token-ids", "1,2"]).token_ids == [1, 2]
    assert parser.parse_args(["status", "--json"]).json
    assert parser.parse_args(["bench", "dispatch", "--transport", "compiled"]).bench == "dispatch"
    assert parser.parse_args(["plan", "--load", "l.json", "--gpus", "2", "--slots-per-gpu", "4"]).gpus == 2
    assert parser.parse_args(["drill", "--kill", "node"]).kill == "node"
