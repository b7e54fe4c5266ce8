"""`agentd serve --workers N`: one supervisor, N worker processes on one port.

Kill one worker: the others go on serving (and reap its runs), the supervisor starts a new one,
on the config the supervisor read. SIGTERM to the supervisor: every worker drains its turns, all
exit, the supervisor exits 0 (also when it comes while they start, or while one is restarted);
a stop sent to the whole process group is one stop, and a second one cuts every drain short.
systemd hears READY once every worker serves. A fleet the server's connections cannot hold is
refused, or, by default, made smaller.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import ssl

import httpx
import psutil
import pytest

from agentd import tls
from agentd.db import connection_budget
from agentd.settings import Settings
from agentd.supervisor import worker_count
from agentd.vocabulary import RunStatus
from tests.process.helpers import LONG_DRAIN_S, database_now, wait_status
from tests.remote.helpers import spawn_remote
from tests.support.daemon import Daemon, poll_until
from tests.support.factories import enqueue_demo, new_account, new_conversation
from tests.support.journal import assistant_messages, run_row
from tests.support.notify import notify_socket

__all__ = ["spawn_remote"]

FAST_REAP = {"lease_ttl_s": 2, "heartbeat_s": 0.5, "reap_interval_s": 0.2, "reap_grace_s": 0}


def worker_pids(daemon: Daemon) -> set[int]:
    """The supervisor's worker processes (its python children)."""
    return {child.pid for child in psutil.Process(daemon.pid).children()
            if "agentd" in " ".join(child.cmdline())}


async def fleet_serving(daemon: Daemon) -> set[int]:
    """Once the supervisor says every worker serves: their pids."""
    await daemon.wait_ready()
    await daemon.wait_for_log('"agentd serving"', 60)
    return await two_workers(daemon)


async def two_workers(daemon: Daemon) -> set[int]:
    async def both() -> set[int] | None:
        pids = worker_pids(daemon)
        return pids if len(pids) == 2 else None

    return await poll_until(both, 30, what="two worker processes")


async def running_on_both(pool, runs) -> dict[int, list]:
    """Wait until every run is running; map worker pid -> its runs (both workers hold some)."""
    ids = [r.run_id for r in runs]

    async def placed() -> dict[int, list] | None:
        rows = await pool.fetch("SELECT id, worker_id FROM agent_run WHERE id = ANY($1) "
                                "AND status = 'running'", ids)
        if len(rows) != len(ids):
            return None
        by_pid: dict[int, list] = {}
        for row in rows:
            pid = int(row["worker_id"].rsplit(":", 2)[1])
            by_pid.setdefault(pid, []).append(row["id"])
        return by_pid if len(by_pid) == 2 else None

    return await poll_until(placed, 20, what="runs running on both workers")


async def test_killed_worker_is_restarted_while_the_other_serves_and_reaps_its_runs(
        spawn_daemon, pool):
    daemon = spawn_daemon(workers=2, max_runs=2, **FAST_REAP)
    await daemon.wait_ready()
    before = await two_workers(daemon)
    account = await new_account(pool)
    runs = [await enqueue_demo(pool, account, await new_conversation(pool, account), f"w{n}",
                               tokens=150, delay_ms=20) for n in range(4)]  # ~3 s each
    by_pid = await running_on_both(pool, runs)
    victim, survivor = max(by_pid), min(by_pid)
    assert {victim, survivor} == before

    psutil.Process(victim).send_signal(signal.SIGKILL)

    # The port still answers (the survivor accepts on the shared socket) …
    assert (await daemon.readyz())["status"] == "ready"
    # … the supervisor starts a new worker in the victim's place …
    async def replaced() -> set[int] | None:
        pids = worker_pids(daemon)
        return pids if len(pids) == 2 and victim not in pids else None

    after = await poll_until(replaced, 30, what="a new worker in place of the killed one")
    assert survivor in after
    await daemon.wait_for_log("worker exited; restarting it", 5)
    # … the victim's runs end failed (reaped, never re-run), the survivor's complete.
    for run_id in by_pid[victim]:
        row = await wait_status(pool, run_id, RunStatus.FAILED, timeout=20)
        assert row["error_code"] is not None
    for run in runs:
        if run.run_id in by_pid[survivor]:
            await wait_status(pool, run.run_id, RunStatus.COMPLETED, timeout=20)
    # The new worker claims and serves: a fresh turn completes with the exact text.
    late = await enqueue_demo(pool, account, await new_conversation(pool, account), "late",
                              tokens=5, delay_ms=0)
    await wait_status(pool, late.run_id, RunStatus.COMPLETED, timeout=20)
    [answer] = await assistant_messages(pool, late.run_id)
    assert answer["content"] == late.expected
    assert daemon.running


async def test_sigterm_drains_every_worker_and_the_supervisor_exits_zero(spawn_daemon, pool):
    daemon = spawn_daemon(workers=2, max_runs=2, drain_s=10)
    await daemon.wait_ready()
    pids = await two_workers(daemon)
    account = await new_account(pool)
    runs = [await enqueue_demo(pool, account, await new_conversation(pool, account), f"d{n}",
                               tokens=60, delay_ms=20) for n in range(4)]  # ~1.2 s each
    await running_on_both(pool, runs)

    daemon.terminate()
    assert await daemon.wait_exit(30) == 0
    for run in runs:  # in flight on both workers at the signal: each drained to completion
        row = await run_row(pool, run.run_id)
        assert row["status"] == RunStatus.COMPLETED, row["error"]
        [answer] = await assistant_messages(pool, run.run_id)
        assert answer["content"] == run.expected
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                   for pid in pids)
    assert "workers stopped" in daemon.log_text()


async def two_workers_with_turns(spawn_daemon, pool, *, tokens: int) -> tuple[Daemon, list]:
    """Two workers with a long drain, each running two demo turns of `tokens` at 20 ms."""
    daemon = spawn_daemon(workers=2, max_runs=2, drain_s=LONG_DRAIN_S)
    await daemon.wait_ready()
    await two_workers(daemon)
    account = await new_account(pool)
    runs = [await enqueue_demo(pool, account, await new_conversation(pool, account), f"t{n}",
                               tokens=tokens, delay_ms=20) for n in range(4)]
    await running_on_both(pool, runs)
    return daemon, runs


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
async def test_a_stop_sent_to_the_whole_group_drains_the_workers_once(spawn_daemon, pool,
                                                                      signum):
    """A terminal's Ctrl-C, systemd's default KillMode and a container's init signal the whole
    process group, the workers too, and the supervisor passes the stop on as well: one stop is
    still one, and the turns in flight finish their drain rather than being cut short as by a
    second stop."""
    daemon, runs = await two_workers_with_turns(spawn_daemon, pool, tokens=600)  # ~12 s each
    signalled_at = await database_now(pool)
    daemon.signal_group(signum)
    assert await daemon.wait_exit(LONG_DRAIN_S / 4) == 0
    for run in runs:
        row = await run_row(pool, run.run_id)
        assert row["status"] == RunStatus.COMPLETED, row["error"]
        assert row["finished_at"] > signalled_at, "finished before the stop: proves nothing"
        [answer] = await assistant_messages(pool, run.run_id)
        assert answer["content"] == run.expected
    assert "cancelling the turns still running" not in daemon.log_text()


async def test_a_second_ctrl_c_cuts_every_workers_drain_short(spawn_daemon, pool):
    daemon, runs = await two_workers_with_turns(spawn_daemon, pool, tokens=3000)  # ~60 s each
    daemon.signal_group(signal.SIGINT)  # Ctrl-C
    # Both workers draining, and the supervisor holding the stop: a second SIGINT sent to a
    # process that has not yet taken the first merges with it (one failure in CI, loaded).
    await poll_until(lambda: daemon.log_text().count("draining the turns in flight") == 2 and
                     "stopping the workers" in daemon.log_text(), 20,
                     what="both workers draining and the supervisor stopping them")
    daemon.signal_group(signal.SIGINT)  # Ctrl-C again
    assert await daemon.wait_exit(LONG_DRAIN_S / 4) == 0
    for run in runs:  # cut short on both workers: failed as when the drain's time is up
        row = await run_row(pool, run.run_id)
        assert (row["status"], row["error_code"]) == (RunStatus.FAILED, "shutdown"), row
    assert "cancelling the turns still running" in daemon.log_text()


async def test_workers_serve_tls_on_the_one_port(spawn_remote, pool):
    daemon = spawn_remote(tls=True, workers=2)
    await daemon.wait_ready()
    await two_workers(daemon)
    # Handshakes over fresh connections until both workers answered: each serves the one
    # certificate (which worker accepts a connection is the kernel's choice, so poll).
    seen: set[str] = set()

    async def both_answered() -> bool:
        async with daemon.client() as client:  # verifies against the daemon's certificate
            response = await client.get("/healthz")
        assert response.status_code == 200
        assert response.http_version == "HTTP/1.1"
        seen.add(response.json()["worker_id"])
        return len(seen) == 2

    await poll_until(both_answered, 30, interval=0.01, what="both workers answering over TLS")
    # Plain HTTP is refused:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as plain:
        try:
            answer = await plain.get(f"http://{daemon.host}:{daemon.port}/healthz")
        except httpx.TransportError:
            return
    assert answer.status_code == 400


async def test_a_restarted_worker_never_serves_another_certificate_than_the_fleets(
        spawn_remote, pool):
    """The certificate on disk changes while the fleet runs (removed here, as a renewal or
    the operator would), then a worker dies. Its replacement used to load or make the new one
    while its sibling served the old: pinned clients refused about one connection in two. It
    now refuses to serve, and every connection presents the fleet's one certificate."""
    daemon = spawn_remote(tls=True, workers=2)
    victim = min(await fleet_serving(daemon))
    served = daemon.cert_path.read_text()
    shutil.rmtree(daemon.cert_path.parent)
    psutil.Process(victim).send_signal(signal.SIGKILL)

    await daemon.wait_for_log("is not the one the other workers serve", 30)
    assert daemon.log_text().count("agentd worker serving") == 2  # no third ever served
    trusted = ssl.create_default_context(cadata=served)
    for _ in range(20):  # fresh handshakes: whichever process accepts, the one certificate
        async with daemon.client(verify=trusted) as client:
            assert (await client.get("/healthz")).status_code == 200


async def test_a_restarted_worker_serves_a_configured_certificates_renewal(
        spawn_remote, pool, tmp_path):
    """A configured certificate renewed on disk (certbot) is served by a worker restarted
    after a crash: clients trust it through its CA, and refusing it would lose the worker
    until agentd restarts. Only the self-signed certificate, which devices pin, is held."""
    made = [tls.server_certificate(Settings(data_dir=tmp_path / name, tls="on").validate())
            for name in ("first", "renewed")]
    data_dir = tmp_path / "fleet"
    (data_dir / "tls").mkdir(parents=True)
    cert, key = data_dir / "tls" / "agentd.crt", data_dir / "tls" / "agentd.key"
    shutil.copy(made[0].cert_path, cert)
    shutil.copy(made[0].key_path, key)
    key.chmod(0o600)
    daemon = spawn_remote(tls=True, workers=2, data_dir=data_dir,
                          env={"AGENTD_TLS_CERT": str(cert), "AGENTD_TLS_KEY": str(key)})
    victim = min(await fleet_serving(daemon))
    for source, target in ((made[1].cert_path, cert), (made[1].key_path, key)):
        shutil.copy(source, target.with_suffix(".new"))
        target.with_suffix(".new").replace(target)
    psutil.Process(victim).send_signal(signal.SIGKILL)

    await poll_until(lambda: daemon.log_text().count("agentd worker serving") == 3, 30,
                     what="the replacement worker serving the renewal")
    assert "is not the one the other workers serve" not in daemon.log_text()
    renewed = ssl.create_default_context(cafile=str(made[1].cert_path))

    async def renewal_served() -> bool:
        with contextlib.suppress(httpx.ConnectError):
            async with daemon.client(verify=renewed) as client:
                return (await client.get("/healthz")).status_code == 200
        return False  # the other worker, with the certificate it started with

    await poll_until(renewal_served, 30, interval=0.01, what="the renewal served")


def processes_of(daemon: Daemon) -> list[psutil.Process]:
    """Every live process started for this daemon (its workers name its private config path)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["status"] != psutil.STATUS_ZOMBIE and \
                    str(daemon.workdir) in " ".join(proc.info["cmdline"] or ()):
                found.append(proc)
    return found


async def test_systemd_hears_ready_once_every_worker_serves_and_how_long_the_stop_may_take(
        spawn_daemon):
    with notify_socket() as notify:
        daemon = spawn_daemon(workers=2, drain_s=70, env=notify.env)
        ready = await notify.wait_for("READY", 60)
        # Both workers had said they serve before the supervisor told systemd.
        assert daemon.log_text().count("agentd worker serving") == 2
        assert ready["STATUS"] == "serving with 2 workers"
        daemon.terminate()
        assert await daemon.wait_exit(30) == 0
        stop = await notify.wait_for("STOPPING", 5)
    # The unit's 60 s would cut a 70 s drain short: the supervisor asks for the drain, its
    # margin for the workers and its own for the database.
    assert int(stop["EXTEND_TIMEOUT_USEC"]) >= 70_000_000 + 30_000_000


async def test_sigterm_while_the_workers_start_stops_them_and_never_reports_ready(spawn_daemon):
    with notify_socket() as notify:
        daemon = spawn_daemon(workers=2, env=notify.env)
        await daemon.wait_for_log("worker started", 60)  # a worker takes ~1 s more to serve
        daemon.terminate()
        assert await daemon.wait_exit(30) == 0
        messages = notify.fields()
    assert not any("READY" in m for m in messages), messages
    assert "agentd serving" not in daemon.log_text()
    assert not processes_of(daemon)


async def test_a_restarted_worker_runs_on_the_config_the_supervisor_read(spawn_daemon, tmp_path):
    config = tmp_path / "agentd.toml"
    config.write_text("max_runs = 3\n")
    daemon = spawn_daemon(workers=2, args=["--config", str(config)])
    victim = min(await fleet_serving(daemon))
    # An edit the operator has not applied yet (and a broken one): a worker restarted now
    # must not run on it, nor fail on it while its sibling runs on the old text.
    config.write_text("max_runs = [broken\n")
    psutil.Process(victim).send_signal(signal.SIGKILL)

    await poll_until(lambda: daemon.log_text().count("agentd worker serving") == 3, 30,
                     what="the replacement worker serving")
    assert "invalid setting" not in daemon.log_text()
    assert victim not in await two_workers(daemon)


async def test_a_worker_that_died_before_the_stop_does_not_make_the_stop_fail(spawn_daemon):
    daemon = spawn_daemon(workers=2)
    victim = min(await fleet_serving(daemon))
    psutil.Process(victim).send_signal(signal.SIGKILL)
    await daemon.wait_for_log("worker exited; restarting it", 10)
    daemon.terminate()  # while it waits to restart it (or as its replacement starts)
    assert await daemon.wait_exit(30) == 0
    assert not processes_of(daemon)


async def test_workers_the_servers_connections_cannot_hold_are_refused(spawn_daemon, pool):
    budget = await connection_budget(pool)
    daemon = spawn_daemon(workers=2, pool_max=budget // 2)  # 2 x (pool_max + 2) > budget
    assert await daemon.wait_exit(60) == 2
    assert "lower workers or pool_max" in daemon.log_text()
    assert not processes_of(daemon)


@pytest.mark.skipif(worker_count(Settings()) < 2,
                    reason="one CPU here: the default is a single process, with no supervisor "
                           "and no fleet to size (the sizing itself is in the unit tier)")
async def test_the_default_worker_count_is_lowered_to_what_the_server_holds(spawn_daemon, pool):
    budget = await connection_budget(pool)
    daemon = spawn_daemon(workers=0, pool_max=budget // 2)
    await daemon.wait_ready()
    assert "starting 1" in daemon.log_text()
    assert len(worker_pids(daemon)) == 1
