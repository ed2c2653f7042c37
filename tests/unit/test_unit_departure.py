"""kiln.departure: work that stops when the client leaves (contract §7)."""

from __future__ import annotations

import asyncio

import pytest

from kiln.departure import ClientLeft, unless_the_client_leaves


class Channel:
    """An ASGI receive whose body was read: the next message is the client's leaving."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


def run(coroutine):
    return asyncio.run(coroutine)


def test_the_client_leaving_stops_the_work_where_it_waits():
    async def main():
        channel, stopped = Channel(), []

        async def work():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                stopped.append(True)
                raise

        asyncio.get_running_loop().call_later(0.05, channel.gone.set)
        with pytest.raises(ClientLeft):
            await unless_the_client_leaves(work(), channel.receive)
        assert stopped == [True]
        assert asyncio.current_task().cancelling() == 0  # nothing left pending on the caller
        await asyncio.sleep(0.01)  # …which goes on waiting undisturbed
    run(main())


def test_work_done_first_gives_its_answer_and_leaves_no_listener_behind():
    async def main():
        channel = Channel()

        async def work():
            await asyncio.sleep(0.01)
            return "answer"

        assert await unless_the_client_leaves(work(), channel.receive) == "answer"
        channel.gone.set()  # the client leaves later: nothing of the listener is left to act on it
        await asyncio.sleep(0.05)
        assert asyncio.current_task().cancelling() == 0
    run(main())


def test_work_that_ends_all_the_same_when_told_to_stop_keeps_its_answer():
    async def main():
        channel = Channel()

        async def work():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                return "finished anyway"

        asyncio.get_running_loop().call_later(0.05, channel.gone.set)
        assert await unless_the_client_leaves(work(), channel.receive) == "finished anyway"
        assert asyncio.current_task().cancelling() == 0
        await asyncio.sleep(0.01)
    run(main())


@pytest.mark.parametrize("client_leaves_too", [False, True], ids=["alone", "with-the-client-leaving"])
def test_a_cancellation_from_elsewhere_is_not_taken_for_the_client_leaving(client_leaves_too):
    """A server that stops cancels the request: that cancellation wins, the client gone or not."""
    async def main():
        channel = Channel()
        caller = asyncio.ensure_future(unless_the_client_leaves(asyncio.sleep(30), channel.receive))
        await asyncio.sleep(0.02)
        if client_leaves_too:
            channel.gone.set()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
    run(main())


def test_a_channel_that_cannot_be_listened_to_lets_the_work_run():
    async def main():
        async def broken():
            raise RuntimeError("no receive here")

        async def work():
            await asyncio.sleep(0.05)
            return 7

        assert await unless_the_client_leaves(work(), broken) == 7
        assert await unless_the_client_leaves(work(), None) == 7
    run(main())


def test_the_works_own_failure_is_its_own():
    async def main():
        async def work():
            raise ValueError("backend said no")

        with pytest.raises(ValueError):
            await unless_the_client_leaves(work(), Channel().receive)
    run(main())


def test_a_client_gone_already_stops_the_work_before_it_begins(recwarn):
    async def main():
        channel, ran = Channel(), []
        channel.gone.set()

        async def work():
            ran.append(True)  # would send the request upstream

        with pytest.raises(ClientLeft):
            await unless_the_client_leaves(work(), channel.receive)
        assert ran == [] and asyncio.current_task().cancelling() == 0
    run(main())
    assert not [w for w in recwarn if "never awaited" in str(w.message)]
