"""What integration tests use to drive and watch a running mesh: one background (non-stop) client, prompts, polling
for a condition instead of sleeping, killing an actor and waiting until it is really gone, and the controller's state.

Test modules import from here (never from each other). Ray is imported only inside the functions that need it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

# Tokens per request of the elastic drills' traffic: short, so the client cycles through its prompts quickly.
MAX_TOKENS = 6


def wait_for(check: Callable[[], T], timeout: float = 60.0, what: str = "condition", every: float = 0.1,
             detail: Callable[[], Any] = lambda: "",
             ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Poll `check()` every `every` s until it returns something truthy, and return that.

    Fails after `timeout` s naming `what` (and `detail()`, e.g. the controller's events). Exceptions of the types in
    `ignore` count as "not yet" (an actor being restored, a name not registered again yet); the last one is reported.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except ignore as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r}) {detail()}")
        time.sleep(every)


class NonStopClient:
    """Sends requests back to back on a thread, cycling through `prompts`, until the `with` block ends.

    `send(prompt) -> token ids` is the request (an ExpertMesh call, a gRPC stream, ...). Every answer is recorded in
    `results`, and as (prompt index, token ids) in `served`; every exception in `errors` (the test asserts there are
    none, so nothing a client would have seen fails silently).
    """

    def __init__(self, send: Callable[[list[int]], list[int]], prompts: Sequence[list[int]]):
        assert prompts, "give at least one prompt"
        self.send = send
        self.prompts = list(prompts)
        self.results: list[list[int]] = []
        self.served: list[tuple[int, list[int]]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            k = i % len(self.prompts)
            try:
                tokens = self.send(self.prompts[k])
                self.served.append((k, tokens))
                self.results.append(tokens)
            except BaseException as exc:  # noqa: BLE001 - the test reports every failure
                self.errors.append(exc)
            i += 1

    def __enter__(self) -> NonStopClient:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(90)

    def wait_for_results(self, n: int, timeout: float = 60) -> None:
        """Until `n` more answers came back (or an error did: the test then reports it)."""
        target = len(self.results) + n
        wait_for(lambda: len(self.results) >= target or self.errors, timeout, f"{n} more requests served")


def mesh_sender(mesh, max_tokens: int = MAX_TOKENS) -> Callable[[list[int]], list[int]]:
    """NonStopClient's `send` for an in-process ExpertMesh: greedy, never stopping at EOS (fixed-length answers)."""
    return lambda ids: mesh.generate(token_ids=ids, max_tokens=max_tokens, stop_at_eos=False).token_ids


def code_prompts(count: int = 16) -> list[str]:
    """Lines of the standard library's own source: the kind of text the embedded model was trained on."""
    import inspect
    import json
    import os

    lines = [line for line in inspect.getsource(json).splitlines() + inspect.getsource(os).splitlines()
             if len(line.strip()) > 20]
    return lines[::25][:count]


def kill_and_wait(name: str, timeout: float = 60.0, namespace: str | None = None) -> None:
    """Kill the actor and return once it is really gone: a call to it fails and its process has exited. Ray marks
    a killed actor dead in its control store before the worker process is gone, and until then a server the actor
    runs on its own thread (its gRPC transport) can still answer; on a loaded machine a whole step fits in that gap,
    so the next step would find the actor alive."""
    import ray
    from ray._private import state

    from expertmesh.cluster.naming import NAMESPACE

    handle = ray.get_actor(name, namespace=namespace or NAMESPACE)  # namespace: another mesh id's
    pid = state.actors(handle._actor_id.hex()).get("Pid") or None  # from the control store: no call to the actor
    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(handle.ready.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            break
        except Exception as exc:  # noqa: BLE001 - Ray may drop a killed actor's entry before the call is submitted
            if "Can't find actor" not in str(exc):
                raise
            break
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.05)
    else:
        raise AssertionError(f"{name} still answers {timeout}s after ray.kill")
    while pid is not None and _process_alive(pid):  # every test cluster runs its workers on this machine
        if time.monotonic() >= deadline:
            raise AssertionError(f"{name}'s process {pid} still runs {timeout}s after ray.kill")
        time.sleep(0.05)


def _process_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """A dead child not yet reaped (the raylet reaps its workers): gone for every purpose here."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def controller_state(mesh) -> dict:
    """The mesh controller's get_state(): actors, events, epoch, control log, requested GPUs."""
    import ray

    return ray.get(mesh.controller.get_state.remote())


def control_log(mesh) -> list[dict]:
    """The controller's elastic control steps so far (each with its reason, imbalance and remap)."""
    return controller_state(mesh)["control"]


class StreamsInFlight:
    """Generate streams on threads, one per request, each recording its tokens as they arrive, so a test can fault
    the server while every one of them is mid-stream. `stub.Generate(request, timeout=...)` is a gRPC
    InferenceStub's; `tokens[i]` is what stream i received, `errors[i]` what it raised (None when it ended well)."""

    def __init__(self, stub, requests: Sequence[Any], timeout: float = 180):
        self.tokens: list[list[int]] = [[] for _ in requests]
        self.errors: list[BaseException | None] = [None] * len(requests)
        self._threads = [threading.Thread(target=self._run, args=(stub, i, r, timeout), daemon=True)
                         for i, r in enumerate(requests)]
        for thread in self._threads:
            thread.start()

    def _run(self, stub, index: int, request, timeout: float) -> None:
        try:
            for message in stub.Generate(request, timeout=timeout):
                if message.HasField("token"):
                    self.tokens[index].extend(message.token.token_ids)
        except BaseException as exc:  # recorded for the test to assert on
            self.errors[index] = exc

    def all_started(self) -> bool:
        """Every stream has received a token (and none has failed yet)."""
        return all(self.tokens) and not any(self.errors)

    def join(self, timeout: float = 180) -> list[list[int]]:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "a stream is still running"
        return self.tokens
