"""Work that stops when the client leaves (contract §7).

Once a request's body has been read, the next message an ASGI server gives the app is
`http.disconnect`: uvicorn gives it when the client closes the connection, Mangum only when
the response is complete. Waiting for it beside the work tells a request whose client has gone,
so the work (an upstream request the model server is still answering) stops at once rather
than running on with the org's slot held.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from starlette.types import Receive

__all__ = ["ClientLeft", "unless_the_client_leaves"]

T = TypeVar("T")


class ClientLeft(Exception):
    """The client closed its connection before the work was done; the work was cancelled."""


async def unless_the_client_leaves(work: Awaitable[T], receive: Receive | None) -> T:
    """`work`'s result; ClientLeft (the work cancelled and waited for) if the client leaves
    first. With no `receive` (nothing to listen to), the work alone. A cancellation of the
    caller reaches the work as it would without the listener."""
    if receive is None:
        return await work
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    listener = loop.create_task(_disconnected(receive))
    try:
        await asyncio.wait((task, listener), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        listener.cancel()
        await asyncio.wait((task, listener))
        raise
    if task.done():
        listener.cancel()
        await asyncio.wait((listener,))
        return task.result()
    task.cancel()
    await asyncio.wait((task,))
    if not task.cancelled() and task.exception() is None:
        return task.result()  # it ended as it was told to stop: its answer stands
    if not task.cancelled() and not isinstance(task.exception(), asyncio.CancelledError):
        raise task.exception()  # type: ignore[misc]  # it failed on its own first
    raise ClientLeft()


async def _disconnected(receive: Receive) -> None:
    """Returns once the server says the client has gone (a failure to listen: never)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a server that cannot be listened to: the work runs on
        await asyncio.Event().wait()
