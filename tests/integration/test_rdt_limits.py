"""Ray Direct Transport (RDT) as Ray 2.60 ships it, pinned: the facts that decide whether expert calls can travel
device to device on it (issue 26; docs/concepts/transports.md: Device to device). GLOO is the collective backend
that runs on CPUs and shares its code path (`CollectiveTensorTransport`) with NCCL, so what holds here holds for
NCCL on GPUs:

- it moves tensors between two *actors* of one collective group, bit for bit;
- the driver, where an embedded or Python-API router runs, can neither fetch a GLOO object nor join a group;
- when the sending actor dies, Ray kills the healthy *receiver* too and destroys the group; the receiver's call
  fails rather than hangs, and a new group over fresh actors can be built afterwards;
- an actor takes part in at most one group per backend (from one creating process).

If a Ray upgrade changes one of these, a test here fails: that is the moment to revisit the `rdt` transport design.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError
from ray.experimental.collective import create_collective_group, destroy_collective_group, get_collective_groups

pytestmark = pytest.mark.usefixtures("local_ray")


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Peer:
    """One end of a GLOO RDT transfer: makes a tensor kept in its own RDT store, or receives one as an argument."""

    def ready(self) -> bool:
        torch.set_num_threads(1)
        return True

    @ray.method(tensor_transport="gloo")
    def make(self, seed: int, rows: int, cols: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(rows, cols, generator=gen).to(torch.bfloat16)  # [rows, cols]

    def bits(self, tensor: torch.Tensor) -> torch.Tensor:
        """The received tensor's raw bits (int16 view of bf16), sent back through the object store."""
        return tensor.view(torch.int16).clone()


def expected(seed: int, rows: int, cols: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen).to(torch.bfloat16).view(torch.int16)


def peers(n: int) -> list:
    handles = [Peer.remote() for _ in range(n)]
    ray.get([h.ready.remote() for h in handles], timeout=120)
    return handles


@pytest.fixture(scope="module")
def group_of_two():
    """(sender, receiver, outsider): a GLOO group of the first two, shared by the tests that only read from it (each
    peer is a process importing torch: minutes of CI on 2 cores if every test started its own)."""
    sender, receiver, outsider = peers(3)
    group = create_collective_group([sender, receiver], backend="gloo")
    yield sender, receiver, outsider
    destroy_collective_group(group)
    for handle in (sender, receiver, outsider):
        ray.kill(handle)


def test_gloo_moves_a_bf16_tensor_between_two_actors_bit_for_bit(group_of_two):
    sender, receiver, _ = group_of_two
    for seed, rows in ((0, 17), (1, 1), (2, 64)):
        got = ray.get(receiver.bits.remote(sender.make.remote(seed, rows, 32)), timeout=60)
        assert torch.equal(got, expected(seed, rows, 32))


def test_the_driver_can_neither_fetch_a_gloo_object_nor_join_a_group(group_of_two):
    """rdt_manager.py:612-616 refuses ray.get on a two-sided transport's object (the object-store detour,
    `_use_object_store=True`, is the `refs` transport's path again); util/collective/collective.py:165,761-769
    refuses a collective group outside an actor. An embedded or Python-API router runs in the driver."""
    sender, _, _ = group_of_two
    ref = sender.make.remote(0, 4, 8)
    with pytest.raises(ValueError, match="two-sided transport"):
        ray.get(ref, timeout=60)
    via_store = ray.get(ref, timeout=60, _use_object_store=True)
    assert torch.equal(via_store.view(torch.int16), expected(0, 4, 8))
    with pytest.raises(RuntimeError, match="inside a Ray actor or task"):
        ray.util.collective.init_collective_group(2, 0, backend="gloo", group_name="driver-joins")


def test_an_actor_joins_at_most_one_group_per_backend(group_of_two):
    """experimental/collective/collective.py:118-124: so a router cannot hold one group per expert actor, and an
    expert actor cannot be in one group per router replica (collective_tensor_transport.py:96-102 also refuses a
    pair found in two groups)."""
    sender, _, outsider = group_of_two
    with pytest.raises(RuntimeError, match="at most one group per backend"):
        create_collective_group([sender, outsider], backend="gloo")


def test_a_dead_sender_gets_its_healthy_receiver_killed_and_the_group_destroyed():
    """rdt_manager.py:316-360 watches every transfer's send and receive calls; on a failure (or after
    RAY_rdt_fetch_fail_timeout_milliseconds, 60 s by default) `_abort_transport` (:362-444) finds GLOO/NCCL cannot
    abort a transfer (collective_tensor_transport.py:45-46) and `ray.kill`s *both* actors (:421-423), then
    destroys the group (:437). For a router in the group, one expert's death would kill the router."""
    sender, receiver, spare = peers(3)
    create_collective_group([sender, receiver], backend="gloo")
    ref = sender.make.remote(3, 8, 8)
    ray.wait([ref], timeout=60)  # the tensor exists in the sender's RDT store
    ray.kill(sender)
    time.sleep(1)
    started = time.monotonic()
    with pytest.raises((RayTaskError, RayActorError)):
        ray.get(receiver.bits.remote(ref), timeout=60)
    assert time.monotonic() - started < 30  # fails, does not hang

    def receiver_alive() -> bool:
        try:
            ray.get(receiver.ready.remote(), timeout=10)
            return True
        except (ActorDiedError, RayActorError):
            return False

    deadline = time.monotonic() + 30
    while receiver_alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not receiver_alive()  # killed by Ray's transfer monitor, though nothing was wrong with it
    deadline = time.monotonic() + 30
    while get_collective_groups([receiver], backend="gloo") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert get_collective_groups([receiver], backend="gloo") == []
    # A group over fresh actors works: rebuilding after a restore is possible, with every member new.
    (fresh,) = peers(1)
    group = create_collective_group([spare, fresh], backend="gloo")
    try:
        got = ray.get(fresh.bits.remote(spare.make.remote(4, 5, 8)), timeout=60)
        assert torch.equal(got, expected(4, 5, 8))
    finally:
        destroy_collective_group(group)
        for handle in (spare, fresh):
            ray.kill(handle)
