"""A stand-in Hugging Face Hub on 127.0.0.1 for download tests: what huggingface_hub (hf_hub_download) and
expertmesh's range reads ask of the Hub, and a ledger of every byte served, per client process.

    with StandInHub() as hub:                        # point HF_ENDPOINT at hub.url (HF_HUB_OFFLINE unset)
        commit = hub.add("acme/tiny", folder)         # serves `folder` as revision "main" of acme/tiny
        ... open the checkpoint ...
        hub.served(pid=os.getpid())                   # [Served(pid, method, repo, file, range, bytes), ...]

Routes: HEAD and GET `/{org}/{name}/resolve/{revision}/{file}` (revision: a branch/tag added with `add`, or the
commit), with `Range: bytes=a-b` (206 + Content-Range), ETag, X-Repo-Commit, Content-Length, Accept-Ranges; errors
carry the X-Error-Code huggingface_hub maps to its exceptions (RepoNotFound, GatedRepo, RevisionNotFound,
EntryNotFound). A repo added with `token=` answers only requests bearing `Authorization: Bearer <token>`.
`ignore_ranges=True` answers ranges with the whole file (200), as a misconfigured proxy would.

The client process of each connection is found from its TCP port in /proc (Linux), so bytes are counted per process
without the client's help (an expert actor, the router replica and the driver are separate processes).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")


@dataclass(frozen=True)
class Served:
    pid: int | None  # the client process (None when it could not be found)
    command: str  # its command line (Ray sets a worker's to "ray::ExpertActor" etc.)
    method: str
    repo: str
    file: str
    range: tuple[int, int] | None  # [start, end) asked, or None for the whole file
    status: int
    nbytes: int  # body bytes sent


@dataclass
class _Repo:
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> commit
    commits: dict[str, Path] = field(default_factory=dict)  # commit -> folder
    token: str | None = None


class StandInHub:
    def __init__(self, ignore_ranges: bool = False, range_delay_s: float = 0.0):
        """range_delay_s: each range answer waits this long first (widens the window concurrent clients race in)."""
        self.repos: dict[str, _Repo] = {}
        self.ignore_ranges = ignore_ranges
        self.range_delay_s = range_delay_s
        self._log: list[Served] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(_Handler):
            owner = hub

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StandInHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo_id: str, folder: Path, revision: str = "main", token: str | None = None) -> str:
        """Serve `folder` as `revision` of `repo_id`; returns its commit (stable: derived from repo and revision)."""
        commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
        repo = self.repos.setdefault(repo_id, _Repo())
        repo.refs[revision] = commit
        repo.commits[commit] = Path(folder)
        repo.token = token
        return commit

    def served(self, pid: int | None = None, command: str | None = None) -> list[Served]:
        with self._lock:
            return [s for s in self._log if (pid is None or s.pid == pid)
                    and (command is None or command in s.command)]

    def reset(self) -> None:
        with self._lock:
            self._log.clear()

    def _record(self, entry: Served) -> None:
        with self._lock:
            self._log.append(entry)


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that hung up early (tests do) is no news
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    owner: StandInHub
    protocol_version = "HTTP/1.1"  # keep-alive, as huggingface_hub's client expects

    def setup(self) -> None:
        super().setup()
        self.pid = _pid_of_client(self.client_address[1], self.server.server_address[1])
        self.client_cmdline = _command(self.pid)

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        match = _RESOLVE.match(self.path.split("?")[0])
        if not match:
            return self._error(404, "RepoNotFound", "", self.path, None)  # file: the whole path asked
        repo_id, revision, filename = match.groups()
        repo = self.owner.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", repo_id, filename, None)
        if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
            return self._error(401, "GatedRepo", repo_id, filename, None)
        commit = repo.refs.get(revision, revision if revision in repo.commits else None)
        if commit is None:
            return self._error(404, "RevisionNotFound", repo_id, filename, None)
        path = repo.commits[commit] / filename
        if not path.is_file():
            return self._error(404, "EntryNotFound", repo_id, filename, commit)
        data = path.read_bytes()
        asked = _RANGE.match(self.headers.get("Range", ""))
        start, end, status = 0, len(data), 200
        if asked and not self.owner.ignore_ranges:
            start, end, status = int(asked.group(1)), min(int(asked.group(2)) + 1, len(data)), 206
            if start >= len(data):
                return self._error(416, "RangeNotSatisfiable", repo_id, filename, commit)
            time.sleep(self.owner.range_delay_s)
        self.send_response(status)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.end_headers()
        sent = 0
        if body:
            self.wfile.write(data[start:end])
            sent = end - start
        self.owner._record(Served(self.pid, self.client_cmdline, self.command, repo_id, filename,
                                  (start, end) if status == 206 else None, status, sent))

    def _error(self, status: int, code: str, repo_id: str, filename: str, commit: str | None) -> None:
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        if commit is not None:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Length", "0")
        self.end_headers()
        self.owner._record(Served(self.pid, self.client_cmdline, self.command, repo_id, filename, None, status, 0))


def _pid_of_client(client_port: int, server_port: int) -> int | None:
    """The process holding the client end of 127.0.0.1:client_port -> :server_port (from /proc; Linux only)."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote = fields[1], fields[2]
            if int(local.rsplit(":", 1)[1], 16) == client_port and int(remote.rsplit(":", 1)[1], 16) == server_port:
                inode = fields[9]
                break
        if inode:
            break
    if not inode:
        return None
    target = f"socket:[{inode}]"
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return pid
            except OSError:
                continue
    return None


def _command(pid: int | None) -> str:
    if pid is None:
        return ""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
    except OSError:
        return ""


def bytes_by_tensor(served: list[Served], folder: Path) -> tuple[dict[str, int], int]:
    """(tensor name -> body bytes served from inside its bytes, all other body bytes: small files, headers), for
    requests of a repo served from `folder` (a whole `.safetensors` file counts as all of its tensors)."""
    from expertmesh.experts.hub_ranges import header_length, parse_header

    per_tensor: dict[str, int] = {}
    other = 0
    headers: dict[str, dict] = {}
    for s in served:
        if not s.nbytes:
            continue
        if not s.file.endswith(".safetensors"):
            other += s.nbytes
            continue
        if s.file not in headers:
            data = (folder / s.file).read_bytes()
            headers[s.file] = parse_header(data[8:8 + header_length(data[:8])])
        start, end = s.range if s.range is not None else (0, s.nbytes)
        inside = 0
        for name, entry in headers[s.file].items():
            overlap = min(end, entry.end) - max(start, entry.start)
            if overlap > 0:
                per_tensor[name] = per_tensor.get(name, 0) + overlap
                inside += overlap
        other += (end - start) - inside
    return per_tensor, other
