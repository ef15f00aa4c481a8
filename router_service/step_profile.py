"""Where a served decode step's time goes: always-on stage clocks in the router replica.

The batcher, the decoder and the dispatcher each add perf_counter differences to one `StageClock` per router (a
dict of running sums, seconds). Admin.GetRouterStats returns them (`stage_seconds`) with the step count, so a
benchmark reads them before and after a measured stretch and turns the deltas into milliseconds per step
(ops/bench/serve_profile.py). Always on: a timed stage costs ~0.6 µs (two perf_counter calls and a dict update, measured
on the 2-core box under load); a decode step at 32 streams over 4 MoE layers times ~100 stages, ~60 µs against a
step of ~30-120 ms there (< 0.2%), so no setting turns them off.

Raw stages (all wall seconds, each measured on the thread that does the work):
  loop.idle           the batcher loop waiting for a request (no sequence active)
  loop.busy           batcher loop iterations that ran a step, whole
  loop.schedule       releasing, admitting and planning the step (inside loop.busy)
  loop.executor       awaiting the forward on the forward thread (inside loop.busy)
  loop.post           the per-sequence work after the forward: text, token events (inside loop.busy)
  post.detokenise     turning generated ids into the text to stream (inside loop.post)
  forward.thread      the forward thread's whole job: forward + routing statistics + sampling (inside loop.executor)
  forward.model       MoEDecoder.forward (inside forward.thread)
  forward.sampling    choosing every sequence's next token, one device read for the step (inside forward.thread)
  model.gating        router logits + top-k (inside forward.model)
  model.lm_head       final norm + lm_head (inside forward.model)
  dispatch.submit     RemoteExperts.submit, whole (inside forward.model)
  dispatch.wait       RemoteExperts.wait, whole (inside forward.model)
  dispatch.plan       no-replica policy + call planning (inside submit / wait)
  dispatch.send       staging rows + transport.submit per call (inside submit / wait)
  dispatch.gather     transport.gather_settled: waiting for the actors' answers (inside wait)
  dispatch.combine    weighted combine of the answers (inside wait)
  serve.emit          the deployment turning batcher events into proto messages (replica event loop)
  front.relay         the gRPC front writing each message to its client (the server process; added by the front)
"""

from __future__ import annotations

import time

__all__ = ["StageClock", "STAGES"]

STAGES = (
    "loop.idle", "loop.busy", "loop.schedule", "loop.executor", "loop.post", "post.detokenise",
    "forward.thread", "forward.model", "forward.sampling", "model.gating", "model.lm_head", "dispatch.submit",
    "dispatch.wait", "dispatch.plan", "dispatch.send", "dispatch.gather", "dispatch.combine", "serve.emit",
    "front.relay",
)


class StageClock:
    """Running sums of seconds per stage. Threads add to distinct stages (the event loop: loop.*, post.*,
    serve.*; the forward thread: forward.*, model.*, dispatch.*), so no lock is needed: a dict item update under
    the GIL cannot lose another thread's key."""

    __slots__ = ("seconds", "_open")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._open: dict[str, float] = {}  # stage -> perf_counter at its start, while it runs (open/close)

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def since(self, stage: str, started: float) -> float:
        """Add perf_counter() - started to `stage`; returns now, so consecutive stages chain."""
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + (now - started)
        return now

    def open(self, stage: str, started: float) -> None:
        """A long stage (the batcher's idle wait) that a snapshot must count up to now while it runs, so a
        stretch between two snapshots holds its own part of a wait that began before it."""
        self._open[stage] = started

    def close(self, stage: str) -> float:
        now = time.perf_counter()
        started = self._open.pop(stage, None)
        if started is not None:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + (now - started)
        return now

    def snapshot(self) -> dict[str, float]:
        """Seconds per stage up to now, running (open) stages included."""
        now = time.perf_counter()
        out = dict(self.seconds)
        for stage, started in list(self._open.items()):
            out[stage] = out.get(stage, 0.0) + (now - started)
        return out
