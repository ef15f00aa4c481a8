"""Where a checkpoint comes from: a folder (local, or a shared filesystem mounted on every node) or a Hugging Face
Hub repo id with an optional revision, the way users start vLLM or Ray Serve LLM.

For a repo id, each process downloads (huggingface_hub, into its node's Hub cache) only what it reads: config.json,
the tokenizer files, the safetensors index, and the `.safetensors` files that hold *its* tensors — an expert actor
the files of its shards, the router the dense files. So a node never pulls a 100 GB checkpoint to serve 8 experts,
and a restored or autoscaled actor fetches the same way on whatever node it lands. With `HF_HUB_OFFLINE=1` the
same code resolves the files from a pre-populated cache (the tests run that way, without a network).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from .checkpoint import CheckpointReader
from .config import MoEModelConfig, load_model_config
from .errors import CheckpointError
from .hub_token import download_token

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Read when present; none is required (a checkpoint without a tokenizer serves token ids).
OPTIONAL_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9_.\-]+$")

# Which tensors a process reads, from the model's config and the checkpoint's tensor names; None = all of them.
TensorSelector = Callable[[MoEModelConfig, set[str]], Iterable[str]]


def companions(wanted: set[str], keys: Iterable[str]) -> set[str]:
    """The checkpoint keys a reader of `wanted` may touch: each name, the tensors stored beside it (`X.weight` ->
    `X.weight_scale_inv` of FP8, `X.bias`), and — for a per-expert name the checkpoint stores fused
    (`...experts.E.gate_proj.weight` absent, `...experts.gate_up_proj` / `..._blocks` / `..._scales` present) —
    the layer's fused expert tensors."""
    keys = set(keys)
    stems = {_stem(name) for name in wanted}
    fused_parents = {m.group(1) for name in wanted if name not in keys and (m := _PER_EXPERT.match(name))}
    out = set()
    for key in keys:
        if _stem(key) in stems:
            out.add(key)
        elif (m := _FUSED.match(key)) and m.group(1) in fused_parents:
            out.add(key)
    return out


def _stem(name: str) -> str:
    """'a.b.weight' / 'a.b.weight_scale_inv' / 'a.b.bias' -> 'a.b'."""
    head, _, last = name.rpartition(".")
    return head if last.startswith(("weight", "bias")) else name


_PER_EXPERT = re.compile(r"^(.*\.experts\.)\d+\.")
_FUSED = re.compile(r"^(.*\.experts\.)(?!\d+\.)[^.]+$")


def is_repo_id(source: str) -> bool:
    """True for 'org/name' that is not an existing path (a folder named like a repo id wins, as in transformers)."""
    return bool(_REPO_ID.match(source)) and not Path(source).expanduser().exists()


def source_problem(source: str) -> str | None:
    """Why `source` cannot be a checkpoint source (for the configuration's one-line error), or None."""
    if Path(source).expanduser().is_dir() or is_repo_id(source):
        return None
    return f"{source} is neither a folder nor a Hugging Face repo id (org/name)"


def fetch_checkpoint(source: str, revision: str | None = None, tensors: TensorSelector | None = None) -> Path:
    """A local folder holding what this process needs of the checkpoint at `source`: the folder itself, or the Hub
    cache's snapshot folder after downloading config, tokenizer, index and the files that hold `tensors`."""
    if not is_repo_id(source):
        folder = Path(source).expanduser()
        if revision is not None:
            raise CheckpointError(f"{source}: a revision ({revision}) applies to a Hub repo id, not to a folder")
        return folder
    config_path = _download(source, "config.json", revision)
    folder = config_path.parent
    for name in OPTIONAL_FILES:
        _download(source, name, revision, required=False)
    index = _download(source, INDEX_FILE, revision, required=False)
    if index is None:
        files = {SINGLE_FILE}
    else:
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{source}: {INDEX_FILE} is not a valid safetensors index") from exc
        if tensors is None:
            files = set(weight_map.values())
        else:
            wanted = set(tensors(load_model_config(folder), set(weight_map)))
            files = {weight_map[name] for name in companions(wanted, weight_map)}
    for name in sorted(files):
        _download(source, name, revision)
    return folder


def dense_tensors(cfg: MoEModelConfig, keys: set[str]) -> Iterable[str]:
    """What a router reads: everything but the routed experts."""
    from .weights import dense_tensor_names, expert_layout

    return dense_tensor_names(cfg, expert_layout(cfg, keys.__contains__))  # the layout names Mixtral's router


def shard_tensors(shards: Iterable[tuple[int, int]]) -> TensorSelector:
    """What an expert actor hosting `shards` reads."""
    hosted = list(shards)

    def select(cfg: MoEModelConfig, keys: set[str]) -> Iterable[str]:
        from .weights import expert_layout, expert_shard_names

        return expert_shard_names(cfg, hosted, expert_layout(cfg, keys.__contains__))  # per-expert or stacked
    return select


def open_checkpoint(source: str, revision: str | None = None, tensors: TensorSelector | None = None
                    ) -> CheckpointReader:
    """A reader over what this process fetched of `source` (see fetch_checkpoint)."""
    return CheckpointReader(fetch_checkpoint(source, revision, tensors), partial=is_repo_id(source))


def _download(repo_id: str, filename: str, revision: str | None, required: bool = True) -> Path | None:
    """One file of the repo, from the node's Hub cache or the Hub. Errors become one CheckpointError line."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    try:
        # token: the process's own HF_TOKEN, else the one the mesh's driver published (experts/hub_token.py)
        return Path(hf_hub_download(repo_id, filename, revision=revision, token=download_token()))
    except LocalEntryNotFoundError:
        if not required:
            return None
        raise CheckpointError(f"{where}: {filename} is not in this node's Hugging Face cache and it cannot be "
                              f"downloaded (offline, HF_HUB_OFFLINE=1, or no network)") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{where}: no such repository on the Hugging Face Hub (or it is gated: set HF_TOKEN)"
                              ) from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{where}: no such revision") from None
    except EntryNotFoundError:
        if not required:
            return None
        raise CheckpointError(f"{where}: the repository has no file {filename}") from None
    except HfHubHTTPError as exc:
        raise CheckpointError(f"{where}: downloading {filename} failed ({exc})") from None
