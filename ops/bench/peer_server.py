"""Start and stop `transformers serve` (the peer of `bench serve --peer`) as a subprocess, offline, on a local
checkpoint folder, on a port the OS picks.

`transformers serve FOLDER` preloads that folder (its model is then the only one served); `--port 0` lets the OS
pick the port and uvicorn's `Uvicorn running on http://HOST:PORT` line on stderr names it. The server takes SIGINT
(uvicorn's orderly shutdown) but with `--continuous-batching` the generation manager's thread can keep the process
alive afterwards (seen with transformers 5.24), so `stop` escalates to SIGTERM and then SIGKILL of the process
group (the server runs in its own session), and says which it took.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

READY = re.compile(r"Uvicorn running on (https?)://([^:\s]+):(\d+)")


class PeerError(RuntimeError):
    """The peer could not be started (missing package, bad checkpoint, timeout): the message names the cause and
    ends with the server's log."""


@dataclass
class PeerServer:
    proc: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT
    log_path: Path
    command: list[str]
    start_s: float
    stop_signal: str | None = None  # the signal that ended it: SIGINT, SIGTERM or SIGKILL
    stragglers_killed: int = 0  # group members still alive grace_s after the server exited, then SIGKILLed

    def log(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, grace_s: float = 15.0) -> int:
        """SIGINT, then SIGTERM, then SIGKILL to the whole process group, each after grace_s; the exit code."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            self.stop_signal = sig.name
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                continue
        self.proc.wait()
        self._reap_group(grace_s)
        return self.proc.returncode

    def _reap_group(self, grace_s: float) -> None:
        """The server's exit does not end the rest of its process group (a CI run found one member left just after
        it): wait up to grace_s for the group to empty, then SIGKILL what is left and wait for that to go."""
        left = self._group_after(grace_s)
        if not left:
            return
        self.stragglers_killed = len(left)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self._group_after(5)

    def _group_after(self, timeout_s: float) -> list[int]:
        """The live members of the server's process group once it is empty, or after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while (left := group_members(self.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left


def proc_stats() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds used: user + system) of every live process, from /proc ({} without it)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after the name: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
        out[int(entry.parent.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return out


def tree_cpu_seconds(pid: int, stats: dict[int, tuple[int, float]] | None = None) -> float | None:
    """CPU seconds used so far by pid and every live descendant (an `expertmesh serve` with its embedded Ray's
    processes; `transformers serve` alone); None where pid is gone or there is no /proc. Descendants that exited
    are not counted, so take differences over stretches where the process tree is stable."""
    stats = proc_stats() if stats is None else stats
    if pid not in stats:
        return None
    children: dict[int, list[int]] = {}
    for child, (parent, _) in stats.items():
        children.setdefault(parent, []).append(child)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats[p][1]
        todo.extend(children.get(p, ()))
    return total


def group_members(pgid: int) -> list[int]:
    """Live processes in process group pgid (from /proc; [] where there is no /proc): the test that the peer
    leaves nothing behind reads this after `stop`."""
    members = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp, ...
            members.append(int(entry.parent.name))
    return members


def peer_command(model_dir: str, extra: tuple[str, ...] = (), continuous_batching: bool = True) -> list[str]:
    """The `transformers serve` command line (as `python -m`, so it is the transformers this Python imports)."""
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir), "--device", "cpu",
           "--host", "127.0.0.1", "--port", "0"]
    if continuous_batching:
        cmd.append("--continuous-batching")
    return cmd + list(extra)


def cache_args(extra: tuple[str, ...], clients: int, context: int | None) -> list[str]:
    """`--cb-num-blocks` sized for `clients` sequences of the model's whole context, unless `extra` sizes the cache
    itself. Left alone, continuous batching on a CPU takes 60-90 % of the machine's free memory for its KV cache
    (11 GB of RSS measured with the embedded model): too much for a shared box, and more than the bench needs."""
    if context is None or any(a.split("=")[0] in ("--cb-num-blocks", "--cb-max-memory-percent") for a in extra):
        return []
    try:
        from transformers import ContinuousBatchingConfig

        page = int(ContinuousBatchingConfig().page_size)  # tokens per block (256 in transformers 5.24)
    except (ImportError, AttributeError, TypeError):
        page = 256
    return ["--cb-num-blocks", str(clients * -(-context // page) + 1)]


def missing_packages() -> list[str]:
    """What `transformers serve` needs that this Python lacks (`pip install "transformers[serving]"` has them)."""
    import importlib.util

    return [m for m in ("transformers", "fastapi", "uvicorn", "accelerate", "openai")
            if importlib.util.find_spec(m) is None]


def start_peer(model_dir: str, extra: tuple[str, ...] = (), timeout: float = 300.0,
               log_path: Path | None = None, continuous_batching: bool = True) -> PeerServer:
    """`transformers serve MODEL_DIR --continuous-batching --port 0`, offline (HF_HUB_OFFLINE: a local folder
    needs no network, and a bench must not reach for one); returns once uvicorn says it listens."""
    missing = missing_packages()
    if missing:
        raise PeerError(f"--peer needs transformers serve's packages; missing: {', '.join(missing)} "
                        f"(pip install \"transformers[serving]\")")
    if not (Path(model_dir) / "config.json").is_file():
        raise PeerError(f"--model: {model_dir} is not a checkpoint folder with a config.json (transformers serve "
                        f"loads it with from_pretrained)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return launch(peer_command(model_dir, extra, continuous_batching), env, timeout, log_path)


def launch(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300.0,
           log_path: Path | None = None) -> PeerServer:
    """Run cmd in its own session, its output to log_path, until its log says where uvicorn listens."""
    if log_path is None:
        log_path = Path(tempfile.mkstemp(prefix="expertmesh-peer-", suffix=".log")[1])
    started = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    server = PeerServer(proc, "", log_path, cmd, 0.0)
    deadline = time.monotonic() + timeout
    try:
        while True:
            match = READY.search(log_path.read_text(errors="replace"))
            if match:
                host = "127.0.0.1" if match.group(2) in ("0.0.0.0", "localhost") else match.group(2)
                server.base_url = f"{match.group(1)}://{host}:{match.group(3)}"
                server.start_s = round(time.perf_counter() - started, 3)
                return server
            if proc.poll() is not None:
                raise PeerError(f"transformers serve exited with {proc.returncode} before listening; log "
                                f"{log_path}:\n{server.log()}")
            if time.monotonic() > deadline:
                raise PeerError(f"transformers serve did not listen within {timeout:.0f} s; log {log_path}:\n"
                                f"{server.log()}")
            time.sleep(0.2)
    except BaseException:
        server.stop(5.0)
        raise
