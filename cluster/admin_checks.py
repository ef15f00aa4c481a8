"""When the controller refuses an operator action (Admin API kill/drain/undrain), and the shape of every answer.
Pure; no Ray.

An answer is {"code": "OK" or the gRPC status name the Admin API answers with, "message": one line}. Refusals are
decided here on the registry's state (cluster/replica_registry.py), before the controller touches any actor.
"""

from __future__ import annotations

from .replica_registry import ReplicaRegistry
from .shard_liveness import describe_shards, orphaned_by_removal


def outcome(code: str, message: str) -> dict:
    """An operator action's result: code "OK" or the gRPC status name the Admin API answers with."""
    return {"code": code, "message": message}


def removal_refusal(registry: ReplicaRegistry, name: str, verb: str, force: bool) -> dict | None:
    """NOT_FOUND for an actor this controller does not run; FAILED_PRECONDITION when taking `name` out (verb:
    "killing", "draining") would leave a shard with no live replica and the caller did not force it."""
    if name not in registry.spec.actor_shards:
        return outcome("NOT_FOUND", f"actor: no expert replica named {name!r}")
    orphaned = orphaned_by_removal(registry.spec.actor_shards, registry.down(), name)
    if orphaned and not force:
        return outcome("FAILED_PRECONDITION",
                       f"{verb} {name} would leave no live replica of {describe_shards(orphaned)}; requests "
                       f"for them would wait and fail. Add replicas first, or set force to do it anyway")
    return None


def drain_refusal(registry: ReplicaRegistry, name: str, force: bool) -> dict | None:
    if name in registry.drained:
        return outcome("FAILED_PRECONDITION", f"{name} is already drained")
    return removal_refusal(registry, name, "draining", force)


def undrain_refusal(registry: ReplicaRegistry, name: str) -> dict | None:
    if name not in registry.spec.actor_shards:
        return outcome("NOT_FOUND", f"actor: no expert replica named {name!r}")
    if name not in registry.drained:
        return outcome("FAILED_PRECONDITION", f"{name} is not drained")
    if name not in registry.slots:
        return outcome("FAILED_PRECONDITION", f"{name}: no record of where it ran; cannot start it again")
    return None
