"""Work that must finish even when the task awaiting it is cancelled."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

__all__ = ["to_the_end"]

T = TypeVar("T")


async def to_the_end(work: Awaitable[T]) -> T:
    """Await `work` to its end, then pass on any cancellation the caller got meanwhile.

    anyio's shielded scopes hold only against anyio's cancellation; a task cancelled natively
    (uvicorn does so to the requests still running when its graceful shutdown times out)
    would stop at its next await. `work` runs in a task of its own, which that cancellation
    does not reach; the caller waits for it whatever it is told, and is cancelled after.
    """
    task = asyncio.ensure_future(work)
    interrupted: asyncio.CancelledError | None = None
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError as exc:
            if task.done():  # the work itself was cancelled: nothing left to wait for
                raise
            interrupted = exc
    if interrupted is not None:
        raise interrupted
    return result
