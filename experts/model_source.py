"""Where a checkpoint comes from: a folder (local, or a shared filesystem mounted on every node) or a Hugging Face
Hub repo id with an optional revision, the way users start vLLM or Ray Serve LLM.

For a repo id, each process downloads (into its node's Hub cache) only what it reads: config.json, the tokenizer
files and the safetensors index as whole files (hf_hub_download), then, of the `.safetensors` files, their headers
and the bytes of the tensors it reads, by range requests (experts/hub_reader.py, experts/hub_fetch.py) — an expert
actor its shards' tensors (or rows of stacked ones), the router the dense tensors, the starting driver headers only.
Published files mix layers (Mixtral's and Qwen3's shards hold attention and experts of several layers each), so
whole files would pull most of a 100 GB checkpoint onto every node; ranges do not. A restored or autoscaled actor
fetches the same way on whatever node it lands, and finds in the node's cache what an earlier actor fetched there.
With `HF_HUB_OFFLINE=1` the same code resolves everything from a pre-populated cache (whole files in the snapshot,
or pieces an earlier online run cached); the tests run that way without a network, and against a stand-in Hub.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from .checkpoint import CheckpointReader
from .config import MoEModelConfig, load_model_config
from .errors import CheckpointError
from .hub_fetch import hub_error
from .hub_token import download_token
from .repo_ids import is_repo_id, source_problem  # noqa: F401  (re-exported: callers import them from here)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Read when present; none is required (a checkpoint without a tokenizer serves token ids).
OPTIONAL_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "chat_template.jinja")
METADATA_FILES = ("config.json", INDEX_FILE, *OPTIONAL_FILES)  # the whole files every process of a repo fetches

# Which tensors a process reads, from the model's config and the checkpoint's tensor names; None = all of them.
TensorSelector = Callable[[MoEModelConfig, set[str]], Iterable[str]]


def NO_TENSORS(cfg: MoEModelConfig, keys: set[str]) -> Iterable[str]:  # noqa: N802  a constant selector
    """Select no tensor: fetch_checkpoint downloads the small files only."""
    return ()


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


def fetch_checkpoint(source: str, revision: str | None = None, tensors: TensorSelector | None = None) -> Path:
    """A local folder with the checkpoint's small files: the folder itself, or the Hub cache's snapshot folder (named
    by its commit) after downloading config, tokenizer and index, and the whole `.safetensors` files holding
    `tensors` (None: all of them; NO_TENSORS: none — open_checkpoint reads tensors by ranges instead)."""
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
    if index is None:  # one file: its names are in it, so any selection but none takes it whole
        files = set() if tensors is NO_TENSORS else {SINGLE_FILE}
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

    return dense_tensor_names(cfg, expert_layout(cfg, keys.__contains__), keys.__contains__)  # layout: Mixtral router


def shard_tensors(shards: Iterable[tuple[int, int]]) -> TensorSelector:
    """What an expert actor hosting `shards` reads."""
    hosted = list(shards)

    def select(cfg: MoEModelConfig, keys: set[str]) -> Iterable[str]:
        from .weights import expert_layout, expert_shard_names

        return expert_shard_names(cfg, hosted, expert_layout(cfg, keys.__contains__))  # per-expert or stacked
    return select


def open_checkpoint(source: str, revision: str | None = None, tensors: TensorSelector | None = None
                    ) -> CheckpointReader:
    """A reader over the checkpoint at `source`. For a repo id: the small files now, tensors by ranges when they
    are read (experts/hub_reader.py); `tensors` names what this process will read, whose files' headers are fetched
    now so a file neither cached nor downloadable fails here, in one line (None: every file's)."""
    if not is_repo_id(source):
        return CheckpointReader(fetch_checkpoint(source, revision))
    from .hub_reader import HubCheckpointReader

    folder = fetch_checkpoint(source, revision, NO_TENSORS)
    # The snapshot folder is named by the commit `revision` resolved to: every piece is read at that commit, and a
    # caller that hands the commit on (start_mesh to its actors and routers) pins them all to the same weights.
    reader = HubCheckpointReader(folder, source, folder.name, where=source + (f"@{revision}" if revision else ""))
    names = set(reader.keys())
    reader.prepare(names if tensors is None else companions(set(tensors(reader.config, names)), names))
    return reader


def _download(repo_id: str, filename: str, revision: str | None, required: bool = True) -> Path | None:
    """One whole file of the repo, from the node's Hub cache or the Hub. Errors become one CheckpointError line."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    if not required and revision is not None and _COMMIT.match(revision):
        # At a commit the cache's answer is final: the file, or a recorded absence (no request either way).
        cached = try_to_load_from_cache(repo_id, filename, revision=revision)
        if isinstance(cached, str):
            return Path(cached)
        if cached is not None:
            return None
    try:
        # token: the process's own HF_TOKEN, else the one the mesh's driver published (experts/hub_token.py)
        return Path(hf_hub_download(repo_id, filename, revision=revision, token=download_token()))
    except (LocalEntryNotFoundError, EntryNotFoundError) as exc:
        if not required:
            return None
        raise hub_error(exc, where, filename) from None
    except Exception as exc:  # noqa: BLE001  huggingface_hub's errors, as one line each
        mapped = hub_error(exc, where, filename)
        if mapped is None:
            raise
        raise mapped from None


_COMMIT = re.compile(r"^[0-9a-f]{40}$")
