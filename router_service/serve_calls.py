"""A Serve unary call that is cancelled on the replica when its caller is.

Why: Ray Serve (2.60) does not do it. A front's handler awaiting a DeploymentResponse is cancelled when its client
goes away (a gRPC cancel or deadline, an HTTP connection closed); Serve's `DeploymentResponse.__await__` then
re-raises CancelledError in the front but leaves the call running on the router replica, which computed the whole
Score / ModelInfer / tokenization for nobody (issue 30). `response.cancel()` is what reaches the replica: Serve
cancels the method's task there, and a forward still queued on the batcher's thread (run_exclusive) never runs.
Streaming calls already cancel theirs in the fronts' `finally`.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol


class Cancellable(Protocol):
    def cancel(self) -> None: ...

    def __await__(self): ...


async def cancel_with_caller(response: Cancellable) -> Any:
    """`await response`, and `response.cancel()` if this await is cancelled (also by asyncio.wait_for's timeout)."""
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()  # idempotent; a call that already finished ignores it
        raise
