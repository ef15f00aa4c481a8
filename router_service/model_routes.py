"""Which mesh answers a request, by the model it names: the routing rule of a front over several meshes
(`expertmesh front --mesh-id a --mesh-id b`, or `--all-meshes`). Pure: no Ray, no gRPC, no HTTP; the fronts map
the two refusals to their own errors (HTTP: OpenAI's 404 model_not_found / 400; gRPC: NOT_FOUND / INVALID_ARGUMENT).

Every mesh serves one model under one name (its `model.name`, default the checkpoint folder's name). A front serves
a set of meshes only if no two of them serve the same name: a request's `model` then names exactly one mesh.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

from ..experts.errors import ConfigError

T = TypeVar("T")
SHOWN_CHARS = 64  # of a client's model name echoed in an error
# gRPC metadata naming the model for a call whose request has no model field (Admin, ServerMetadata), on a front
# over several meshes.
MODEL_METADATA = "x-expertmesh-model"


class UnknownModel(LookupError):
    """The request names a model no mesh of this front serves (HTTP 404 model_not_found, gRPC NOT_FOUND)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = f"{field}: {message}"


class ModelRequired(ValueError):
    """The request names no model and the front serves several (HTTP 400, gRPC INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = f"{field}: {message}"


def _shown(name: str) -> str:
    return repr(name if len(name) <= SHOWN_CHARS else name[:SHOWN_CHARS] + "…")


def model_routes(served: Iterable[tuple[str, str]]) -> dict[str, str]:
    """(mesh id, served model name) pairs -> {model name: mesh id}, in the given order (the first is the front's
    first mesh: /v1/models lists them so). ConfigError naming `model.name` when two meshes serve one name, or
    `mesh.id` when a mesh is given twice."""
    routes: dict[str, str] = {}
    seen: set[str] = set()
    for mesh_id, model in served:
        if mesh_id in seen:
            raise ConfigError("mesh.id", f"mesh {mesh_id!r} given twice; list each mesh once")
        seen.add(mesh_id)
        if not model:
            raise ConfigError("model.name", f"mesh {mesh_id!r} serves no model name")
        if model in routes:
            raise ConfigError("model.name", f"meshes {routes[model]!r} and {mesh_id!r} both serve model "
                                            f"{model!r}; model names must be unique across the meshes one front "
                                            "serves (deploy one of them with another --model-name)")
        routes[model] = mesh_id
    if not routes:
        raise ConfigError("mesh.id", "no mesh to serve")
    return routes


def choose(requested: str | None, targets: Mapping[str, T], field: str = "model") -> T:
    """The target (a mesh's handle, forwarder, ...) serving model `requested`; `targets` maps served model names to
    them. An empty or absent `requested` picks the only target, and is refused (ModelRequired) when there are
    several: a front never guesses which model a client meant. A name no target serves: UnknownModel.
    `field` is the request field holding the name, for the error (`model`, KServe's `model_name` or `name`)."""
    assert targets, "a front serves at least one mesh"
    if not requested:
        if len(targets) == 1:
            return next(iter(targets.values()))
        raise ModelRequired(field, f"required: this front serves several models ({', '.join(map(repr, targets))})")
    if requested in targets:
        return targets[requested]
    raise UnknownModel(field, f"unknown model {_shown(requested)}; this front serves "
                              f"{', '.join(map(repr, targets))}")
