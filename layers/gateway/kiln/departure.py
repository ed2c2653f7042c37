"""Work that stops when the client leaves (contract §7).

Once a request's body has been read, the next message an ASGI server gives the app is
`http.disconnect`: uvicorn gives it when the client closes the connection, Mangum only when
the response is complete. Waiting for it beside the work tells a request whose client has gone,
so the work (an upstream request the model server is still answering) stops at once rather
than running on with the org's slot held.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Awaitable, TypeVar

from starlette.types import Receive

__all__ = ["ClientLeft", "disconnected", "unless_the_client_leaves"]

T = TypeVar("T")


class ClientLeft(Exception):
    """The client closed its connection before the work was done; the work was cancelled."""


async def unless_the_client_leaves(work: Awaitable[T], receive: Receive | None) -> T:
    """`work`'s result; ClientLeft if the client leaves first (the work is cancelled where it
    waits, as a timeout cancels it). With no `receive` (nothing to listen to), the work alone.
    A cancellation of the caller from elsewhere reaches the work and the caller as before.

    The work runs in the caller's own task; only the listener is a task of its own, and it
    cancels the caller's task when the client leaves (the cancellation is then taken back,
    `uncancel`, so that none is left pending)."""
    if receive is None:
        return await work
    task = asyncio.current_task()
    assert task is not None
    left = False

    async def listen() -> None:
        nonlocal left
        await disconnected(receive)
        left = True
        task.cancel()

    listener = asyncio.get_running_loop().create_task(listen())
    started = False
    try:
        await asyncio.sleep(0)  # the listener's first look: a client gone already stops the work before it starts
        started = True
        result = await work
    except asyncio.CancelledError:
        if left and task.uncancel() == 0:  # ours, and no other
            raise ClientLeft() from None
        raise
    finally:
        listener.cancel()
        if not started and inspect.iscoroutine(work):
            work.close()  # never begun: nothing of it ran
    if left:
        task.uncancel()  # the work ended all the same: its answer stands
    return result


async def disconnected(receive: Receive) -> None:
    """Returns once the server says the client has gone (a failure to listen: never)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a server that cannot be listened to: the work runs on
        await asyncio.Event().wait()
