"""Real-GPU check: expert actors compute on CUDA and stay exact. Skips cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch

# `-m gpu` selects it; without CUDA it skips (it stays in the default run, so a GPU CI machine runs it unasked).
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_experts_run_on_the_gpu_and_match_the_reference(checkpoints):
    import ray

    from expertmesh.experts.reference import load_reference_model
    from expertmesh.router_service.mesh import ExpertMesh, MeshConfig

    ids = [3, 14, 15, 92, 65, 35]
    want = load_reference_model(checkpoints["mixtral"]).forward([torch.tensor(ids)])[0]
    ray.init(address="local", include_dashboard=False)
    try:
        with ExpertMesh(MeshConfig.from_dict({"model": {"path": str(checkpoints["mixtral"])},
                                                    "controller": {"enabled": False}})) as mesh:
            infos = mesh.actor_info()
            got = mesh.score(ids)
    finally:
        ray.shutdown()
    assert all(i["device"].startswith("cuda") and i["gpu_ids"] for i in infos)
    assert (got - want).abs().max().item() <= 1e-4
