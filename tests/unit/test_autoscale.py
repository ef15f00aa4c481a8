"""Per-expert autoscaling policy (cluster/autoscale.py): pure, fake clock, no Ray."""

import numpy as np
import pytest

from expertmesh.cluster.autoscale import AutoscaleConfig, AutoscaleContext, AutoscaleState, decide


def cfg(**kw) -> AutoscaleConfig:
    base = dict(target_load_per_replica=100.0, max_gpus=8, base_gpus=4, slots_per_gpu=2, downscale_delay_s=60.0)
    base.update(kw)
    return AutoscaleConfig(**base)


def run(loads, replicas, config, gpus=4, dt=1.0, state=None):
    """Feed a sequence of loads [T, L, E]; apply each decision; return (counts over time, decisions)."""
    state = state or AutoscaleState()
    counts, decisions = [], []
    for t, load in enumerate(loads):
        decision, state = decide(AutoscaleContext(now=t * dt, load=load, replicas=replicas, gpus=gpus), state, config)
        replicas = decision.replicas
        counts.append(replicas.copy())
        decisions.append(decision)
    return np.array(counts), decisions


def test_pinned_scale_up_and_down():
    load = np.array([[350.0, 100.0, 10.0, 0.0]])
    replicas = np.array([[1, 1, 2, 1]])
    d, state = decide(AutoscaleContext(0.0, load, replicas, gpus=4), AutoscaleState(), cfg(downscale_delay_s=0))
    # 350 per replica > 120: ceil(350/100) = 4 replicas; 100 is at target; expert 2 (10 over 2) is cold: -> 1.
    assert d.replicas.tolist() == [[4, 1, 1, 1]]
    assert d.add == [(0, 0, 3)] and d.remove == [(0, 2, 1)]
    assert d.request_gpus == 0 and not d.pending.any()


def test_noise_around_the_upscale_threshold_does_not_flap():
    rng = np.random.default_rng(0)
    config = cfg()
    loads = 120.0 * rng.uniform(0.85, 1.15, size=(400, 2, 4))  # ±15% around target x upscale_threshold
    counts, _ = run(loads, np.ones((2, 4), dtype=np.int64), config)
    changes = (np.diff(counts, axis=0) != 0).sum(axis=0)
    assert changes.max() <= 1  # each shard scales up once (to 2) and stays
    assert (counts[-1] == 2).all()


def test_noise_around_the_downscale_threshold_does_not_flap():
    rng = np.random.default_rng(1)
    loads = 60.0 * rng.uniform(0.8, 1.2, size=(400, 1, 6))  # 2 replicas; cold whenever load ≤ 60
    counts, _ = run(loads, np.full((1, 6), 2, dtype=np.int64), cfg(downscale_delay_s=30.0))
    changes = (np.diff(np.concatenate([np.full((1, 1, 6), 2), counts]), axis=0) != 0).sum(axis=0)
    assert changes.max() <= 1  # at most one step down, never back up


def test_load_shift_scales_out_then_in_after_the_cooldown():
    config = cfg(downscale_delay_s=30.0)
    hot = np.array([[500.0, 50.0, 50.0, 50.0]])
    calm = np.array([[50.0, 50.0, 50.0, 50.0]])
    loads = [hot] * 10 + [calm] * 60
    counts, _ = run(loads, np.ones((1, 4), dtype=np.int64), config, gpus=8)
    assert counts[0, 0, 0] == 5  # out at once: ceil(500 / 100)
    assert (counts[10:40, 0, 0] == 5).all()  # calm since t=10: nothing leaves before 30 s of cold
    assert counts[40, 0, 0] == 1  # t=40: cooled down for 30 s -> back to 1 (50 / 1 ≤ 60)
    assert (counts[40:, 0, 0] == 1).all()
    assert (counts[:, 0, 1:] == 1).all()


def test_never_exceeds_the_budget_and_requests_gpus_when_full():
    rng = np.random.default_rng(2)
    config = cfg(max_gpus=6, base_gpus=3, slots_per_gpu=2, max_replicas_per_shard=6)
    budget = config.max_gpus * config.slots_per_gpu
    replicas = np.ones((3, 5), dtype=np.int64)
    state = AutoscaleState()
    gpus = 3
    for t in range(300):
        load = rng.pareto(1.2, size=(3, 5)) * 80
        d, state = decide(AutoscaleContext(float(t), load, replicas, gpus=gpus), state, config)
        assert ((d.replicas + d.pending).sum(axis=1) <= budget).all()
        assert (d.replicas.sum(axis=1) <= gpus * config.slots_per_gpu).all()  # placed adds fit the live GPUs
        assert (d.replicas >= 1).all() and (d.replicas <= min(6, gpus)).all()
        assert 0 <= d.request_gpus <= config.max_gpus
        if d.pending.any():
            assert d.request_gpus > gpus
        replicas = d.replicas
        if d.request_gpus > gpus and t % 7 == 0:
            gpus = d.request_gpus  # the autoscaler delivered


def test_request_when_no_room_then_release_after_scale_down():
    config = cfg(max_gpus=8, base_gpus=2, slots_per_gpu=1, downscale_delay_s=10.0)
    replicas = np.ones((1, 2), dtype=np.int64)
    hot = np.array([[400.0, 10.0]])
    d, state = decide(AutoscaleContext(0.0, hot, replicas, gpus=2), AutoscaleState(), config)
    assert d.add == [] and d.pending.tolist() == [[3, 0]]
    assert d.request_gpus == 5  # 1 + 4 replicas + 1 for expert 1 = 5 GPUs of one slot
    # Nodes join: the pending replicas are placed and the request is held while they are needed.
    d, state = decide(AutoscaleContext(1.0, hot, d.replicas, gpus=5), state, config)
    assert d.replicas.tolist() == [[4, 1]] and d.request_gpus == 5
    calm = np.array([[10.0, 10.0]])
    replicas = d.replicas
    for t in range(2, 20):
        d, state = decide(AutoscaleContext(float(t), calm, replicas, gpus=5), state, config)
        replicas = d.replicas
    assert replicas.tolist() == [[1, 1]] and d.request_gpus == 0  # released


@pytest.mark.parametrize("field,value,match", [
    ("target_load_per_replica", 0.0, "target_load_per_replica"),
    ("downscale_threshold", 1.0, "downscale_threshold"),
    ("upscale_threshold", 0.9, "upscale_threshold"),
    ("base_gpus", 9, "base_gpus"),
    ("max_replicas_per_shard", 0, "max_replicas_per_shard"),
])
def test_bad_config_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        cfg(**{field: value}).validate()


def test_a_shard_never_gets_more_replicas_than_live_gpus():
    # 2 GPUs with 4 slots each: room for 8 replicas, but a shard can have only one per GPU.
    config = cfg(max_gpus=6, base_gpus=2, slots_per_gpu=4)
    d, _ = decide(AutoscaleContext(0.0, np.array([[500.0, 10.0]]), np.ones((1, 2), dtype=np.int64), gpus=2),
                  AutoscaleState(), config)
    assert d.replicas.tolist() == [[2, 1]] and d.pending.tolist() == [[3, 0]]
    assert d.request_gpus == 5  # five replicas of expert 0 need five GPUs


def test_lost_gpus_trim_what_no_longer_fits():
    config = cfg(max_gpus=4, base_gpus=4, slots_per_gpu=2, target_load_per_replica=100.0)
    replicas = np.array([[4, 2, 1, 1]])  # 8 replicas on 4 GPUs x 2 slots
    load = np.array([[400.0, 200.0, 100.0, 100.0]])
    d, _ = decide(AutoscaleContext(0.0, load, replicas, gpus=3), AutoscaleState(), config)
    # 3 GPUs: expert 0 at most 3 replicas, the layer at most 6; what is cut waits and asks for the GPU back.
    assert d.replicas.max() <= 3 and d.replicas.sum() <= 6 and (d.replicas >= 1).all()
    assert (d.replicas + d.pending).tolist() == [[4, 2, 1, 1]]
    assert d.request_gpus == 4
    assert sum(n for *_, n in d.remove) == 2
