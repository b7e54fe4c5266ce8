"""Every test is marked with what it needs, so a selection like `-m "not chaos and not slow"`
works without each file remembering to say so (the markers are declared in pyproject.toml and
`--strict-markers` refuses any other).

- `database`: uses a PostgreSQL database of its own (any test asking for `dsn` or `pool`).
- `process`: runs `agentd serve` daemons (a spawning fixture, or a tier made of them: process,
  remote, terminal, chaos). A one-shot command (`agentd doctor`, `agenttui --help`) does not count.
- `terminal`: drives the real agenttui binary under a pseudo-terminal (tests/terminal).
- `chaos`: the storm (tests/chaos): daemons killed and paused, PostgreSQL restarted.
- `slow`: takes tens of seconds on its own (listed in SLOW below, or the chaos tier).
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

# Tiers whose every test runs daemons or other real processes, whatever its fixtures say.
PROCESS_TIERS = {"process", "remote", "terminal", "chaos"}
DATABASE_FIXTURES = {"pg_admin_dsn", "dsn", "pool"}
PROCESS_FIXTURES = {"spawn_daemon", "spawn_remote", "daemon", "api"}
DIRECTORY_MARKERS = {"terminal": "terminal", "chaos": "chaos"}

# Tests that take ten seconds or more on their own (measured with --durations against a server
# on two cores; see tests/README.md). The chaos tier is slow as a whole.
SLOW = {
    "tests/process/test_saturation.py::"
    "test_saturated_daemon_keeps_every_live_turn_and_every_client_sees_the_answer",
    "tests/process/test_fleet.py::test_status_shows_the_fleet_workers_queue_by_account_and_owners",
    "tests/process/test_fleet.py::test_a_quiet_account_starts_within_one_claim_cycle_of_a_busy_backlog",
    "tests/process/test_fleet.py::test_account_set_limits_that_two_daemons_never_exceed_together",
    "tests/process/test_blocked_loop.py::"
    "test_blocked_event_loop_loses_its_runs_and_its_late_writes_are_fenced_out",
    "tests/api/test_fuzz.py::test_fuzzed_requests_never_5xx_and_always_match_the_document",
    "tests/integration/test_lifecycle_races.py::"
    "test_delete_racing_the_worker_the_claimer_and_an_attaching_device_leaves_nothing",
    "tests/streams/test_two_daemons.py::test_stream_on_daemon_b_follows_a_run_executing_on_daemon_a",
    "tests/streams/test_resume.py::"
    "test_conversation_stream_dropped_at_random_delivers_every_turn_exactly_once",
    "tests/remote/test_tls.py::test_pair_login_and_ask_over_https_then_a_new_certificate_is_refused",
    "tests/remote/test_limits.py::test_a_head_trickled_byte_by_byte_is_cut_off_within_the_timeout",
    "tests/remote/test_limits.py::"
    "test_the_head_timer_never_cuts_a_request_in_progress_or_a_reused_connection",
    "tests/tui/test_app.py::"
    "test_daemon_killed_mid_stream_reconnects_and_shows_the_whole_answer_once",
    "tests/tui/test_lifecycle.py::test_archive_then_delete_and_every_device_sees_it_go",
    "tests/tui/test_approval.py::test_both_devices_prompt_one_approves_and_both_show_who",
    "tests/tui/test_cli.py::test_a_local_daemon_sets_up_the_client_by_itself",
    "tests/terminal/test_agenttui.py::test_two_devices_side_by_side_see_one_conversation_stream",
}


def tier(item: pytest.Item) -> str | None:
    """The test's directory under tests/ (its tier), or None for a test outside one."""
    try:
        parts = Path(item.path).resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        where = tier(item)
        names = set(getattr(item, "fixturenames", ()))
        wanted = set()
        if names & DATABASE_FIXTURES:
            wanted.add("database")
        if names & PROCESS_FIXTURES or where in PROCESS_TIERS:
            wanted.add("process")
        if where in DIRECTORY_MARKERS:
            wanted.add(DIRECTORY_MARKERS[where])
        if where == "chaos" or item.nodeid.split("[")[0] in SLOW:
            wanted.add("slow")
        for name in sorted(wanted - {m.name for m in item.iter_markers()}):
            item.add_marker(name)
