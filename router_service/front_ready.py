"""What `expertmesh serve` and `expertmesh front` both do once their fronts listen: print the ready lines that
scripts and tests wait for, then serve until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import signal

from .config import ServerConfig


def announce_ready(server: ServerConfig, model_name: str, port: int, http_port: int | None) -> None:
    """The HTTP line first (whoever waits for the serving line then knows both ports), then the serving line; tests
    and scripts wait for this exact text."""
    scheme = "tls" if server.tls_cert else "plaintext"
    if http_port is not None:
        print(f"expertmesh http on {server.host}:{http_port} ({'https' if scheme == 'tls' else 'http'})", flush=True)
    print(f"expertmesh serving {model_name} on {server.host}:{port} ({scheme})", flush=True)


async def wait_for_stop_signal() -> None:
    """Return at the first SIGINT or SIGTERM (from the running event loop's signal handlers)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
