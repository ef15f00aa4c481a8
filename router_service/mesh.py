"""The Python API: start the mesh (router_service/startup.py) and route requests from this process.

    from expertmesh.router_service.mesh import ExpertMesh, MeshConfig
    with ExpertMesh(MeshConfig()) as mesh:             # embedded default model, embedded Ray
        print(mesh.generate(prompt="def ", max_tokens=20).text)

    config = MeshConfig.from_dict({"model": {"path": "/models/mixtral"}, "experts": {"replicas_per_expert": 2}})
"""

from __future__ import annotations

from .config import ConfigError, MeshConfig
from .router import Generation, RequestError, Router
from .startup import MeshRuntime, start_mesh

__all__ = ["ExpertMesh", "MeshConfig", "ConfigError", "Generation", "RequestError"]


class ExpertMesh:
    """Expert pool + controller (start_mesh) + a router in this process."""

    def __init__(self, config: MeshConfig | None = None):
        self.config = config or MeshConfig()
        self.router: Router | None = None
        # The router runs here, not as a Serve replica: no GPU is kept for router replicas.
        self.runtime: MeshRuntime = start_mesh(self.config, serve_routers=False)
        try:
            self.router = Router(self.runtime.spec, self.runtime.pool.actors, self.config, reader=self.runtime.reader)
        except BaseException:
            self.runtime.stop()
            raise

    # The router's surface, for callers and tests.
    @property
    def model(self):
        return self.router.model

    @property
    def backend(self):
        return self.router.backend

    @property
    def model_config(self):
        return self.router.model_config

    @property
    def pool(self):
        return self.runtime.pool

    @property
    def controller(self):
        return self.runtime.controller

    @property
    def actors(self):
        return self.runtime.pool.actors

    @property
    def slots(self):
        return self.runtime.pool.slots

    def actor_info(self) -> list[dict]:
        return self.runtime.pool.info()

    def score(self, token_ids: list[int]):
        return self.router.score(token_ids)

    def score_batch(self, batch: list[list[int]]):
        return self.router.score_batch(batch)

    def generate(self, *args, **kwargs) -> Generation:
        return self.router.generate(*args, **kwargs)

    def shutdown(self) -> None:
        if self.router is not None:
            self.router.close()  # a compiled graph goes before its actors
            self.router = None
        self.runtime.stop()

    def __enter__(self) -> ExpertMesh:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
