"""Load progress: the reporter publishes throttled records and always the last one; status shows loading actors."""

from __future__ import annotations

from expertmesh.experts.load_progress import LoadProgress, ProgressReporter, progress_key, read_progress
from expertmesh.ops.commands.status import load_note
from expertmesh.protos import admin_pb2


def test_reporter_throttles_and_always_publishes_the_end():
    store: dict[bytes, bytes] = {}
    writes: list[LoadProgress] = []
    now = [100.0]

    def put(key, value):
        store[key] = value
        writes.append(LoadProgress.decode(value))

    rep = ProgressReporter("expert-e1-r0", 1000, put, every_s=1.0, clock=lambda: now[0])
    rep.add(100)
    rep.add(100)  # same instant: not published
    now[0] += 1.5
    rep.add(300)
    rep.finish()
    assert [w.loaded_bytes for w in writes] == [0, 500, 500] and writes[-1].done
    got = read_progress("expert-e1-r0", store.get)
    assert got == writes[-1] and got.fraction == 0.5
    assert read_progress("expert-e9-r0", store.get) is None
    assert progress_key("x") == b"expertmesh/load/x"


def test_a_failing_store_never_fails_the_load_and_errors_are_recorded():
    def broken(key, value):
        raise ConnectionError("gcs down")

    rep = ProgressReporter("a", 10, broken)
    rep.add(5)
    rep.finish(error="CheckpointError: bad file")  # no exception
    store: dict[bytes, bytes] = {}
    ProgressReporter("b", 10, store.__setitem__).finish(error="OSError: disk")
    assert read_progress("b", store.get).error == "OSError: disk"


def test_status_shows_loading_and_failed_actors():
    loading = admin_pb2.ReplicaState(actor="expert-e0-r0", load_bytes=3 << 30, load_total_bytes=10 << 30)
    assert load_note(loading) == "  loading 3.0/10.0 GiB"
    assert load_note(admin_pb2.ReplicaState(load_bytes=5, load_total_bytes=5)) == ""
    assert "load failed: OSError" in load_note(admin_pb2.ReplicaState(load_error="OSError: disk"))
