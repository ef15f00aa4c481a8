"""Run `expertmesh serve` as a subprocess, the way a user starts it, for benchmarks, drills and tests.

It waits for the server's ready line (`expertmesh serving <model> on <host>:<port> (<scheme>)`, so `--port 0`
works), keeps draining its stdout so it never blocks on a full pipe, and stops it with SIGINT (the server's own
orderly shutdown), killing it only if that takes too long.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

READY = re.compile(r"expertmesh serving (\S+) on ([\d.]+):(\d+) \((tls|plaintext)\)")
HTTP_READY = re.compile(r"expertmesh http on ([\d.]+):(\d+) \((https?)\)")  # printed before READY with --http-port


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    target: str  # host:port to dial
    model_name: str
    log_path: Path  # the server's stderr
    http_url: str | None = None  # http(s)://host:port of the HTTP front (--http-port), else None

    @property
    def port(self) -> int:
        return int(self.target.rsplit(":", 1)[1])

    def log(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(args: list[str], log_path: Path | None = None, timeout: float = 600,
                 new_session: bool = False, env: dict[str, str] | None = None, command: str = "serve") -> ServerProcess:
    """`expertmesh serve --port 0 <args>`; returns once it is ready. new_session keeps a terminal's Ctrl-C away
    from the server so the caller can stop it in order. env: the server's whole environment (None: ours).
    command: "front" runs `expertmesh front` instead (the fronts for a mesh already deployed; the same ready line)."""
    if log_path is None:
        log_path = Path(tempfile.mkstemp(prefix="expertmesh-serve-", suffix=".log")[1])
    command = [sys.executable, "-m", "expertmesh.ops.cli", command, "--port", "0", *args]
    with log_path.open("w") as err:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=new_session, env=env)
    found: list[re.Match] = []
    http: list[re.Match] = []

    def watch() -> None:
        for line in proc.stdout:
            if HTTP_READY.search(line):
                http.append(HTTP_READY.search(line))
            match = READY.search(line)
            if match:
                found.append(match)
                break
        for _ in proc.stdout:  # keep draining so the server never blocks on a full pipe
            pass

    threading.Thread(target=watch, daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        while not found and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    except BaseException:
        ServerProcess(proc, "", "", log_path).stop(30)
        raise
    if not found:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise RuntimeError(f"expertmesh serve did not become ready (exit {proc.returncode}); log {log_path}:\n"
                           f"{log_path.read_text(errors='replace')[-4000:]}")
    match = found[0]
    host = "127.0.0.1" if match.group(2) == "0.0.0.0" else match.group(2)
    http_url = None
    if http:
        http_host = "127.0.0.1" if http[0].group(1) == "0.0.0.0" else http[0].group(1)
        http_url = f"{http[0].group(3)}://{http_host}:{http[0].group(2)}"
    return ServerProcess(proc=proc, target=f"{host}:{match.group(3)}", model_name=match.group(1), log_path=log_path,
                         http_url=http_url)
