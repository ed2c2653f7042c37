"""kiln.shielded.to_the_end: work that a cancelled caller still waits for."""

from __future__ import annotations

import asyncio

import pytest

from kiln.shielded import to_the_end


def test_the_work_finishes_and_the_caller_is_cancelled_after_it():
    seen: list[str] = []

    async def work() -> str:
        await asyncio.sleep(0.05)
        seen.append("done")
        return "result"

    async def caller() -> None:
        await to_the_end(work())
        seen.append("went on")  # never: the cancellation is passed on

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(caller())
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.01)
        task.cancel()  # told twice, still waits
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert seen == ["done"]


def test_an_uncancelled_caller_gets_the_result_and_the_works_errors():
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    async def fail() -> None:
        await asyncio.sleep(0)
        raise ValueError("storage said no")

    assert asyncio.run(to_the_end(answer())) == 42
    with pytest.raises(ValueError, match="storage said no"):
        asyncio.run(to_the_end(fail()))


def test_work_cancelled_itself_cancels_its_caller():
    async def main() -> None:
        work = asyncio.get_running_loop().create_task(asyncio.sleep(10))
        asyncio.get_running_loop().call_later(0.01, work.cancel)
        with pytest.raises(asyncio.CancelledError):
            await to_the_end(work)

    asyncio.run(main())
