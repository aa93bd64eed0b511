"""The pool manager's liveness probe says why a worker is dead: the reason its registry record keeps for the
operator tells a worker that does not answer (frozen, or its node cut off) from one Ray cannot reach (its
process or node gone) and from one whose engine thread stopped."""
from __future__ import annotations

import asyncio

from cluster.health import probe


class Client:
    def __init__(self, answer) -> None:
        self.answer = answer

    async def alive(self) -> bool:
        if self.answer == "hang":
            await asyncio.Event().wait()
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def test_probe_says_why_a_worker_is_dead():
    async def go():
        return await asyncio.gather(
            probe(Client(True)), probe(Client("hang"), timeout_s=0.05), probe(Client(False)),
            probe(Client(RuntimeError("The actor is unavailable: connection reset\nthe rest"))))

    answers, frozen, stopped, unreachable = asyncio.run(go())
    assert answers is None
    assert frozen == "no answer to its health probe within 0.05 s"
    assert stopped == "health probe: its engine thread has stopped"
    assert unreachable == "health probe failed: RuntimeError: The actor is unavailable: connection reset"
