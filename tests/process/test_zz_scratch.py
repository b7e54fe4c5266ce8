import pytest
from agentd.queue import stop_conversation
from tests.process.helpers import *

@pytest.mark.parametrize("i", range(5))
async def test_scratch(spawn_daemon, pool, i):
    d = spawn_daemon(flush_ms=1)
    await d.wait_ready()
    account = await new_account(pool)
    conv = await new_conversation(pool, account)
    turn = await enqueue_demo(pool, account, conv, "busy", tokens=100000, delay_ms=0)
    await wait_streaming(pool, turn.run_id, timeout=10, min_deltas=2)
    await stop_conversation(pool, account_id=account, conversation_id=conv)
    row = await wait_status(pool, turn.run_id, TERMINAL, timeout=10)
    print(row["status"], row["error"])
    assert row["status"] == "cancelled", str(row["error"]) + d.log_text()
