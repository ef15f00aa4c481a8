"""The cluster secret that authenticates router -> expert calls over the gRPC transport (experts/grpc_server.py).

Generated once per Ray cluster (32 random bytes, URL-safe text) by whichever process asks first -- start_mesh asks
at start-up -- and kept in Ray's GCS key-value store, like the routing table (cluster/table_store.py). Expert actors
and routers read it from there; it never appears in a configuration file, a command line or a log. So it is exactly
as well kept as Ray's GCS: with Ray's token authentication on (the default for a cluster that `ray.init` starts in
Ray 2.60, `RAY_AUTH_MODE=token` otherwise), only holders of the Ray token can read it; without it, anyone who can
reach the GCS port can -- and could run code on the cluster anyway.
"""

from __future__ import annotations

import secrets

from ..cluster.mesh_store import cluster_store

_KEY = "transport-secret"  # one per Ray cluster, shared by its meshes (cluster/mesh_store.py: cluster_store)


def transport_secret() -> str:
    """This cluster's secret, created on the first call. Safe to race: the first writer wins, everyone reads it."""
    store = cluster_store()
    raw = store.get(_KEY)
    if not raw:
        store.put(_KEY, secrets.token_urlsafe(32).encode(), overwrite=False)
        raw = store.get(_KEY)
    return raw.decode()
