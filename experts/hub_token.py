"""The Hugging Face token of the process that starts a mesh, for every process that fetches checkpoint files.

Gated repos (Mixtral is one) need a token on every node that downloads: the driver (dense files), each router
replica and each expert actor, including actors the controller restores or adds later on other nodes. Node-level
configuration gives it to every process on a node (HF_TOKEN from a Kubernetes Secret, or HF_TOKEN_PATH naming a file
that `ray up`'s file_mounts copy to every node: cluster/configs/). When only the driver has it (`HF_TOKEN=... expertmesh
serve --address ...` against a cluster whose nodes were started without it), start_mesh publishes it in Ray's GCS
key-value store, like the transport secret (experts/transport_secret.py), and each download that has no token of its
own reads it from there.

Not through the actors' `runtime_env.env_vars`: Ray 2.60's runtime-env agent writes every runtime env it creates,
env vars included, verbatim into each node's `runtime_env_agent.log` ("Creating runtime env: {...}"; seen in a local
run). The key-value store is readable only by holders of the Ray token when token authentication is on
(cluster/configs turn it on), who can run code on the cluster anyway. The token is never logged here.

Which token a download uses: the process's own HF_TOKEN (or HUGGING_FACE_HUB_TOKEN) first, as huggingface_hub does;
else the published one; else huggingface_hub's token file (HF_TOKEN_PATH, default $HF_HOME/token).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")  # huggingface_hub's order
_KEY = "hf-token"  # one per Ray cluster (cluster/mesh_store.py: cluster_store); the last driver's token wins


def env_token(environ: Mapping[str, str]) -> str | None:
    """The token `environ` gives huggingface_hub, stripped; None when neither variable is set to a non-blank value."""
    for name in ENV_VARS:
        value = environ.get(name, "").strip()
        if value:
            return value
    return None


def token_for_download(environ: Mapping[str, str], published: str | None) -> str | None:
    """What to pass as hf_hub_download(token=...): None (huggingface_hub's own lookup) when the process has a token
    in its environment or nothing was published; else the published token."""
    if env_token(environ) is not None or published is None:
        return None
    return published.strip() or None


def publish_hub_token(environ: Mapping[str, str] | None = None) -> bool:
    """Driver side, with Ray connected: store this process's HF_TOKEN for the cluster's downloads. True when one was
    stored; without one, an earlier driver's token stays (a redeploy without HF_TOKEN keeps working)."""
    from ..cluster.mesh_store import cluster_store

    token = env_token(os.environ if environ is None else environ)
    if token is None:
        return False
    cluster_store().put(_KEY, token.encode())
    return True


def published_hub_token() -> str | None:
    """The token a driver published on the Ray cluster this process is connected to; None without Ray or token."""
    import ray

    if not ray.is_initialized():
        return None
    from ..cluster.mesh_store import cluster_store

    raw = cluster_store().get(_KEY)
    return raw.decode() if raw else None


def download_token() -> str | None:
    """hf_hub_download's token= for this process (see token_for_download)."""
    if env_token(os.environ) is not None:
        return None  # huggingface_hub reads it from the environment; no need to ask the GCS
    return token_for_download(os.environ, published_hub_token())
