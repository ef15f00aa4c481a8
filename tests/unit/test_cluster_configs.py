"""The deployment configs users run: `ray up` YAMLs pass Ray's own validation, the Serve config passes Serve's
schema and names importable code, and the KubeRay manifest embeds the same Serve config. Then what a new user trips
over: the Hub cache's owner, the Ray and Hugging Face tokens on every node type and pod, what `ray up` and `docker
build` copy, where Serve's proxies run, and the README's cluster commands with optional variables unset. No Ray is
started."""

from __future__ import annotations

import copy
import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

CONFIGS = Path(__file__).resolve().parents[2] / "cluster" / "configs"


def load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


@pytest.mark.parametrize("name", ["aws-gpu.yaml", "gcp-gpu.yaml"])
def test_launcher_yaml_passes_ray_validation(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load(name)
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)  # raises on any schema or consistency error
    head = config["available_node_types"][config["head_node_type"]]
    workers = [t for n, t in config["available_node_types"].items() if n != config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0, "experts belong on GPU workers"
    assert workers and all(0 < w["min_workers"] <= w["max_workers"] for w in workers)
    setup = " ".join(config["setup_commands"])
    assert setup.index("torch") < setup.index("expertmesh"), "install a CUDA torch before expertmesh"


def test_launcher_validation_rejects_a_broken_yaml():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load("aws-gpu.yaml")
    config["head_node_type"] = "no-such-type"
    with pytest.raises(ValueError):
        validate_config(prepare_config(config))


def test_serve_config_passes_serve_schema_and_names_importable_code():
    from ray.serve.schema import ServeDeploySchema

    config = load("serve_config.yaml")
    schema = ServeDeploySchema.model_validate(config)
    app = schema.applications[0]
    module, attr = app.import_path.split(":")
    assert callable(getattr(importlib.import_module(module), attr))
    for path in config["grpc_options"]["grpc_servicer_functions"]:
        module, _, attr = path.rpartition(".")
        assert callable(getattr(importlib.import_module(module), attr)), path
    assert config["http_options"]["host"] == "127.0.0.1"


def test_kuberay_manifest_embeds_the_serve_config():
    manifest = load("kuberay-rayservice.yaml")
    assert manifest["kind"] == "RayService" and manifest["apiVersion"] == "ray.io/v1"
    assert yaml.safe_load(manifest["spec"]["serveConfigV2"]) == load("serve_config.yaml")
    workers = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    limits = workers[0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) >= 1


PLACEHOLDER = re.compile(r"your[-_ ]|<[^<>\n]*>|\bTODO\b|CHANGEME|example\.com|\bxxx+\b|\bREPLACE", re.IGNORECASE)
DOCKERFILE = CONFIGS.parent / "docker" / "Dockerfile"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")) + [DOCKERFILE], ids=lambda p: p.name)
def test_no_placeholders(path):
    text = path.read_text()
    found = [m.group(0) for m in PLACEHOLDER.finditer(text)]
    assert not found, f"{path.name}: placeholder text {found}"


def test_the_placeholder_check_catches_placeholders():
    for text in ("git+https://github.com/your-org/x", "image: <registry>/x", "project_id: CHANGEME"):
        assert PLACEHOLDER.search(text), text


def _dockerfile() -> tuple[str, str]:
    """(base image, torch install line) of the Dockerfile."""
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines() if line.strip() and not line.startswith("#")]
    base = next(line.split()[1] for line in lines if line.startswith("FROM "))
    torch = next(line for line in lines if "torch==" in line)
    return base, torch


@pytest.mark.parametrize("name", ["aws-gpu.yaml", "gcp-gpu.yaml"])
def test_launcher_yaml_runs_the_dockerfile_s_image_and_installs_this_checkout(name):
    config = load(name)
    base, torch_line = _dockerfile()
    assert config["docker"]["image"] == base
    pin = re.search(r"torch==\S+ --index-url \S+", torch_line).group(0)
    setup = config["setup_commands"]
    assert any(pin in command for command in setup), f"{name}: install {pin} as the Dockerfile does"
    # Every path a setup command installs from is mounted on every node.
    mounted = set(config["file_mounts"])
    for command in setup:
        for path in re.findall(r"(/home/\S+)", command):
            assert any(path == m or path.startswith(m + "/") for m in mounted), f"{name}: {path} is not mounted"
    assert config["file_mounts"]["/home/ray/expertmesh"] == "."
    # The nodes' OS image is pinned to an NVIDIA-driver image (not Ray's default AMI).
    for node in config["available_node_types"].values():
        image = node["node_config"].get("ImageId") or node["node_config"]["disks"][0]["initializeParams"]["sourceImage"]
        assert "nvidia" in image


def test_kuberay_runs_the_dockerfile_s_image_and_serves_a_hub_model():
    manifest = load("kuberay-rayservice.yaml")
    cluster = manifest["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    images = {c["image"] for pod in pods for c in pod["template"]["spec"]["containers"]}
    assert images == {"expertmesh:0.1.0"}
    assert "-t expertmesh:0.1.0" in DOCKERFILE.read_text()
    args = load("serve_config.yaml")["applications"][0]["args"]
    from expertmesh.experts.model_source import is_repo_id

    assert is_repo_id(args["model"]["path"]) and args["model"]["dtype"] == "bfloat16" and args["router"]["gpus"] == 1


# ---- What a new user trips over: cache ownership, tokens, what gets copied, readiness, the README's commands ----

REPO = CONFIGS.parents[1]
LAUNCHERS = ["aws-gpu.yaml", "gcp-gpu.yaml"]
HF_CACHE = "/home/ray/.cache/huggingface"
RAY_UID, RAY_GID = 1000, 100  # the `ray` user of rayproject/ray images (docker/base-deps: --uid 1000 --gid 100)


def _run_options(config: dict, node_type: str) -> list[str]:
    """docker run options a node of `node_type` starts its container with, as Ray's launcher combines them."""
    docker = {**config["docker"], **config["available_node_types"][node_type].get("docker", {})}
    role = "head_run_options" if node_type == config["head_node_type"] else "worker_run_options"
    return list(docker.get("run_options", [])) + list(docker.get(role, []))


def _container_env(options: list[str]) -> dict[str, str]:
    env = {}
    for option in options:
        match = re.fullmatch(r"(?:-e|--env)[ =](\w+)(?:=(\S*))?", option.strip())
        if match:
            env[match.group(1)] = match.group(2)
    return env


def _mounted_from(config: dict, path: str) -> str | None:
    """The local side of the file_mount that holds container path `path`, or None."""
    for remote, local in config["file_mounts"].items():
        if path == remote or path.startswith(remote.rstrip("/") + "/"):
            return local
    return None


def _docker_run_line(config: dict, node_type: str) -> str:
    """The `docker run` line Ray's launcher builds for a node of this type (ray.autoscaler._private.docker)."""
    from ray.autoscaler._private.docker import docker_start_cmds

    return docker_start_cmds("ubuntu", config["docker"]["image"], config["file_mounts"], "ray_container",
                             _run_options(config, node_type), config["cluster_name"], "/home/ray", "docker")


@pytest.mark.parametrize("name", LAUNCHERS)
def test_hub_cache_is_created_for_the_container_user_before_docker_runs(name):
    config = load(name)
    volumes = [o.split(None, 1)[1] for o in config["docker"]["run_options"] if o.startswith("-v ")]
    host_dir = next(v.split(":")[0] for v in volumes if v.split(":")[1] == HF_CACHE)
    # initialization_commands run on the host before `docker run` (Ray's updater, run_env="host"); without them
    # docker creates the missing folder as root and the container's `ray` user cannot write the Hub cache.
    init = " && ".join(config["initialization_commands"])
    assert f"mkdir -p {host_dir}" in init
    assert re.search(rf"chown (-R )?{RAY_UID}:{RAY_GID} {re.escape(host_dir)}\b", init), init
    for node_type in config["available_node_types"]:
        assert f"-v {host_dir}:{HF_CACHE}" in _docker_run_line(config, node_type)


def _kuberay_pods() -> list[tuple[str, dict]]:
    cluster = load("kuberay-rayservice.yaml")["spec"]["rayClusterConfig"]
    return [("head", cluster["headGroupSpec"]["template"]["spec"])] + [
        (group["groupName"], group["template"]["spec"]) for group in cluster["workerGroupSpecs"]]


def test_kuberay_hub_cache_is_a_volume_the_container_user_can_write():
    for group, pod in _kuberay_pods():
        ray_container = pod["containers"][0]
        mounts = {m["mountPath"]: m["name"] for m in ray_container["volumeMounts"]}
        assert HF_CACHE in mounts, f"{group}: downloads would land in the container's writable layer"
        volume = next(v for v in pod["volumes"] if v["name"] == mounts[HF_CACHE])
        assert "emptyDir" in volume, group
        assert pod["securityContext"]["fsGroup"] == RAY_GID, group
    dockerfile = DOCKERFILE.read_text()
    assert f"ENV HF_HOME={HF_CACHE}" in dockerfile and f"mkdir -p {HF_CACHE}" in dockerfile


@pytest.mark.parametrize("name", LAUNCHERS)
def test_every_node_type_gets_the_ray_token_and_the_hugging_face_token(name):
    config = load(name)
    for node_type in config["available_node_types"]:
        env = _container_env(_run_options(config, node_type))
        assert env.get("RAY_AUTH_MODE") == "token", node_type
        for var in ("RAY_AUTH_TOKEN_PATH", "HF_TOKEN_PATH"):
            path = env.get(var)
            assert path and path.startswith("/"), f"{node_type}: {var}"
            local = _mounted_from(config, path)
            # From a folder outside the checkout: never inside what rsync/docker copy from the repository.
            assert local is not None and local.startswith("~/"), f"{node_type}: {var}={path} is not file-mounted"
        line = _docker_run_line(config, node_type)
        assert "-e RAY_AUTH_MODE=token" in line and "-e HF_TOKEN_PATH=" in line
        # Not `-e HF_TOKEN` without a value: docker would read it from ray up's SSH session on the node (unset).
        assert not re.search(r"-e HF_TOKEN(\s|$)", line)


@pytest.mark.parametrize("name", LAUNCHERS)
def test_ray_starts_only_inside_the_token_mode_container(name):
    config = load(name)
    assert config["docker"]["container_name"], "without docker, the run options' environment would not apply"
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands") for c in config[key]
              if "ray start" in c]
    assert len(starts) == 2
    host_side = " ".join(config.get("initialization_commands", []))
    assert "ray start" not in host_side
    everything = json.dumps(config)
    assert not re.search(r"RAY_AUTH_MODE=(?!token)", everything), "a command switches token mode off"
    token_path = _container_env(config["docker"]["run_options"])["RAY_AUTH_TOKEN_PATH"]
    # ray up stops with one line, before `ray start`, when the token file is missing.
    assert any(token_path in c and "exit 1" in c for c in config["setup_commands"])


def test_kuberay_turns_token_auth_on_and_passes_the_hugging_face_token_to_every_pod():
    manifest = load("kuberay-rayservice.yaml")
    cluster = manifest["spec"]["rayClusterConfig"]
    # KubeRay >= 1.5.1: RayClusterSpec.AuthOptions `json:"authOptions"`, Mode `json:"mode"` in {disabled, token};
    # the operator then sets RAY_AUTH_MODE and RAY_AUTH_TOKEN (from the Secret it makes) in every Ray container, and
    # validation requires rayVersion >= 2.52.0.
    assert cluster["authOptions"] == {"mode": "token"}
    assert tuple(int(x) for x in cluster["rayVersion"].split(".")) >= (2, 52, 0)
    for group, pod in _kuberay_pods():
        env = {e["name"]: e for e in pod["containers"][0].get("env", [])}
        assert "RAY_AUTH_MODE" not in env or env["RAY_AUTH_MODE"].get("value") == "token", group
        ref = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "expertmesh-hf-token" and ref["key"] == "HF_TOKEN", group
        assert "value" not in env["HF_TOKEN"], f"{group}: a token written into the manifest"


def test_serve_proxies_run_where_kuberay_s_readiness_probe_looks_for_them():
    config = load("serve_config.yaml")
    # HeadOnly leaves every RayService worker pod NotReady (KubeRay's worker readiness probe checks the local Serve
    # proxy; ray-project/kuberay#4994). EveryNode: a proxy on each node with a Serve replica (the router pods).
    assert config["proxy_location"] == "EveryNode"
    head = load("kuberay-rayservice.yaml")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    ports = {p["name"]: p["containerPort"] for p in head["containers"][0]["ports"]}
    # KubeRay builds the serve Service from the head container's port named "serve" (and refuses a RayService
    # without one); ours is Serve's gRPC proxy.
    assert ports["serve"] == config["grpc_options"]["port"]


@pytest.mark.parametrize("name", LAUNCHERS)
def test_ray_up_does_not_copy_the_virtualenv_or_git_metadata(name):
    from ray.autoscaler._private.command_runner import SSHCommandRunner

    config = load(name)
    excludes = config["rsync_exclude"]
    assert {".venv", ".git"} <= set(excludes)
    assert config["rsync_filter"] == [".gitignore"] and (REPO / ".gitignore").is_file()
    # The rsync arguments Ray builds from them (for the checkout, the secrets folder and head -> worker syncs).
    args = SSHCommandRunner._create_rsync_filter_args(None, config)
    assert ["--exclude", ".venv"] == args[args.index(".venv") - 1:args.index(".venv") + 1]
    assert "--exclude" == args[args.index(".git") - 1]
    assert "dir-merge,- .gitignore" in args


def _dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule, enough for these patterns: a path is left out when it or a parent folder matches."""
    parts = path.split("/")
    for pattern in patterns:
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            return True
    return False


def test_dockerignore_keeps_the_virtualenv_and_git_metadata_out_of_the_image():
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert not any(p.startswith("!") for p in patterns)
    for path in (".venv/bin/python", ".git/HEAD", ".git", "experts/__pycache__/actor.cpython-311.pyc",
                 "expertmesh.egg-info/PKG-INFO", "bench_out/x.json"):
        assert _dockerignore_excludes(patterns, path), path
    # What `pip install /home/ray/expertmesh` in the Dockerfile needs stays in.
    for path in ("pyproject.toml", "README.md", "experts/actor.py", "experts/default_model/config.json",
                 "protos/inference_pb2.py", "router_service/static/index.html", "cluster/configs/serve_config.yaml"):
        assert not _dockerignore_excludes(patterns, path), path


# docs/deployment: the shell blocks of the GPU-cluster and KubeRay pages must work as pasted, optional variables unset.
OPTIONAL = ("HF_TOKEN", "EXPERTMESH_TOKEN", "EXPERTMESH_ADMIN_TOKEN", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH",
            "RAY_AUTH_MODE", "RAY_ADDRESS")
_VAR = re.compile(r"\\?\$(?:\{(?P<braced>[A-Za-z_]\w*)(?P<op>[^}]*)\}|(?P<bare>[A-Za-z_]\w*))")


def _gpu_section_blocks() -> list[str]:
    pages = ("docs/deployment/gpu-clusters.md", "docs/deployment/kuberay.md")
    text = "\n".join((REPO / page).read_text() for page in pages)
    return re.findall(r"```bash\n(.*?)```", text, re.DOTALL)


def _unguarded(block: str) -> list[str]:
    """$VAR / ${VAR} / \\$VAR uses (locally or in a remote command) without a :- :+ :? guard, except for variables
    the block assigns itself and HOME/PATH."""
    code = "\n".join(line for line in block.splitlines() if not line.lstrip().startswith("#"))
    assigned = set(re.findall(r"(?:^|[\s;(&|'\"])(?:export\s+)?([A-Za-z_]\w*)=", code)) | {"HOME", "PATH"}
    found = []
    for match in _VAR.finditer(code):
        name = match.group("braced") or match.group("bare")
        guarded = match.group("braced") and re.match(r":?[-+?]", match.group("op"))
        if not guarded and name not in assigned:
            found.append(match.group(0))
    return found


def test_the_unguarded_variable_check_catches_the_old_readme_command():
    assert _unguarded('ray exec c.yaml "expertmesh serve --auth-token \\$EXPERTMESH_TOKEN"') == ["\\$EXPERTMESH_TOKEN"]
    assert _unguarded('x ${EXPERTMESH_TOKEN:+--auth-token "$EXPERTMESH_TOKEN"}') == []  # expanded only when set
    assert _unguarded('expertmesh generate --auth-token "$EXPERTMESH_TOKEN"') == ['$EXPERTMESH_TOKEN']
    assert _unguarded('export T="$(cat f)"\nuse "$T" "${HF_TOKEN:-}" "${HF_TOKEN:?set it}"') == []


def test_readme_cluster_commands_are_safe_with_optional_variables_unset(tmp_path):
    blocks = _gpu_section_blocks()
    assert len(blocks) >= 3
    for block in blocks:
        assert not _unguarded(block), f"unguarded optional variables {_unguarded(block)} in:\n{block}"
        checked = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr


def test_readme_cluster_commands_run_under_set_u(tmp_path):
    """Each block, run by bash with `set -eu`: cloud and cluster commands are recorded instead of run (bash's
    command_not_found_handle, PATH holding only harmless tools), HOME is a scratch folder, the optional variables
    are unset and the required ones (${X:?...}) set."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("mkdir", "chmod", "cat"):
        (tools / tool).symlink_to(shutil.which(tool))
    (tools / "python3").symlink_to(sys.executable)
    for block in _gpu_section_blocks():
        required = set(re.findall(r"\$\{(\w+):\?", block))
        env = {"PATH": str(tools), "HOME": str(tmp_path / "home"), **{name: "x" for name in required}}
        assert not (set(OPTIONAL) - required) & set(env)
        (tmp_path / "home").mkdir(exist_ok=True)
        script = "command_not_found_handle() { echo \"ran: $*\"; return 0; }\nset -eu\n" + block
        done = subprocess.run([shutil.which("bash"), "-c", script], env=env, capture_output=True, text=True,
                              errors="replace", cwd=tmp_path, timeout=60)
        assert done.returncode == 0, f"{done.stderr}\n--- in:\n{block}"
    assert (tmp_path / "home" / ".expertmesh" / "secrets" / "ray_auth_token").stat().st_size > 0
    assert not (tmp_path / "home" / ".expertmesh" / "secrets" / "hf_token").exists()  # HF_TOKEN was unset
