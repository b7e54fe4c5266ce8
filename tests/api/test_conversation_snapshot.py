"""GET /v1/conversations/{id} is the server's authority that every client reconciles to, so it
is read from one snapshot: a turn it lists as queued or running has its question in the
transcript it returns, however fast turns are posted and finish beside the read.
"""

from __future__ import annotations

import asyncio

from tests.api.conftest import Api
from tests.api.helpers import start_run, wait_run
from tests.support.factories import create_conversation

POSTS = 150  # turns posted back to back while the reader reads
MIN_READS = 300  # reads that saw a turn listed, each a chance to fall between two statements


async def test_a_listed_turn_always_has_its_question_in_the_same_answer(api: Api):
    conversation_id = await create_conversation(api.a)
    path = f"/v1/conversations/{conversation_id}"
    posted: list[str] = []
    done = asyncio.Event()

    async def post() -> None:
        try:
            for n in range(POSTS):
                posted.append((await start_run(api.a, conversation_id, f"question {n}"))["run_id"])
        finally:
            done.set()

    async def read() -> tuple[int, list[str]]:
        seen, torn = 0, []
        while not done.is_set() or seen < MIN_READS:
            response = await api.a.get(path)
            assert response.status_code == 200, response.text
            state = response.json()
            messages = {m["id"] for m in state["messages"]}
            for run in state["runs"]:
                seen += 1
                if run["user_message_id"] not in messages:
                    torn.append(f"run {run['id']} ({run['status']}) without its question")
            if done.is_set() and not state["runs"]:
                break  # every turn ended: nothing more to see
        return seen, torn

    async with asyncio.timeout(240):
        _, (seen, torn) = await asyncio.gather(post(), read())
        await wait_run(api.a, posted[-1])
    assert not torn, f"{len(torn)} of {seen} listed turns: {torn[:5]}"
    assert seen >= 50, f"the reader saw only {seen} listed turns: the test proved nothing"
