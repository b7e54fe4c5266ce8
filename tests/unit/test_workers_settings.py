"""`workers` and `pooler`: how many processes serve, and which DSN a session-bound job uses.

By default one worker per CPU the process may use, a cgroup quota included (a container's, or
systemd's CPUQuota=), and no more than the server's connection budget holds at full pools; a
count the operator chose that does not fit is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentd import supervisor
from agentd.settings import Settings, SettingsError, load_settings
from agentd.supervisor import cgroup_cpu_limit, fit_workers, worker_count


def _load(tmp_path: Path, **env: str):
    config = tmp_path / "agentd.toml"
    config.write_text("")
    return load_settings(env={"AGENTD_CONFIG": str(config), **env})


def test_workers_default_to_one_per_core_and_an_explicit_count_wins(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "cgroup_cpu_limit", lambda: None)
    assert worker_count(_load(tmp_path)) == len(os.sched_getaffinity(0))
    assert worker_count(_load(tmp_path, AGENTD_WORKERS="3")) == 3
    flagged = load_settings(env={"AGENTD_CONFIG": str(tmp_path / "agentd.toml")},
                            overrides={"workers": 2})
    assert worker_count(flagged) == 2


@pytest.mark.parametrize("value", ["-1", "257", "two"])
def test_a_bad_worker_count_names_the_setting(tmp_path: Path, value: str) -> None:
    with pytest.raises(SettingsError, match="workers"):
        _load(tmp_path, AGENTD_WORKERS=value)


def test_transaction_pooling_needs_a_direct_hub_dsn_used_for_sessions(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="hub_dsn"):
        _load(tmp_path, AGENTD_POOLER="transaction", AGENTD_DSN="postgresql://b:6432/a")
    with pytest.raises(SettingsError, match="pooler"):
        _load(tmp_path, AGENTD_POOLER="statement")
    pooled = _load(tmp_path, AGENTD_POOLER="transaction", AGENTD_DSN="postgresql://b:6432/a",
                   AGENTD_HUB_DSN="postgresql://db:5432/a")
    assert pooled.pooled and pooled.direct_dsn("postgresql://b:6432/a") == \
        "postgresql://db:5432/a"
    direct = _load(tmp_path, AGENTD_DSN="postgresql://db:5432/a",
                   AGENTD_HUB_DSN="postgresql://db2:5432/a")
    assert not direct.pooled and direct.direct_dsn("postgresql://db:5432/a") == \
        "postgresql://db:5432/a"


def test_a_cpu_quota_narrows_the_default_count(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(supervisor, "cgroup_cpu_limit", lambda: 0.5)
    assert worker_count(_load(tmp_path)) == 1
    monkeypatch.setattr(supervisor, "cgroup_cpu_limit", lambda: 1.2)  # 1.2 CPUs keep 2 busy
    assert worker_count(_load(tmp_path)) == min(cpus, 2)
    monkeypatch.setattr(supervisor, "cgroup_cpu_limit", lambda: 512.0)
    assert worker_count(_load(tmp_path)) == cpus
    assert worker_count(_load(tmp_path, AGENTD_WORKERS="3")) == 3  # an explicit count wins


def _cgroup(tmp_path: Path, membership: str, files: dict[str, str]) -> float | None:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "membership").write_text(membership)
    return cgroup_cpu_limit(root, tmp_path / "membership")


def test_v2_the_tightest_quota_of_the_cgroup_and_its_parents(tmp_path: Path) -> None:
    files = {"user.slice/cpu.max": "150000 100000\n",
             "user.slice/agentd.service/cpu.max": "max 100000\n"}
    assert _cgroup(tmp_path, "0::/user.slice/agentd.service\n", files) == 1.5
    files["user.slice/agentd.service/cpu.max"] = "50000 100000\n"
    assert _cgroup(tmp_path, "0::/user.slice/agentd.service\n", files) == 0.5


def test_v2_a_container_sees_its_own_quota_at_the_root(tmp_path: Path) -> None:
    assert _cgroup(tmp_path, "0::/\n", {"cpu.max": "200000 100000\n"}) == 2.0
    # Told a host path its view does not have: the levels it can see still count.
    assert _cgroup(tmp_path, "0::/docker/abc\n", {"cpu.max": "300000 100000\n"}) == 3.0


def test_hybrid_the_v1_cpu_controller_beside_an_empty_v2_hierarchy(tmp_path: Path) -> None:
    files = {"cpu/app/cpu.cfs_quota_us": "150000\n", "cpu/app/cpu.cfs_period_us": "100000\n"}
    membership = "0::/app\n1:cpu:/app\n2:cpuacct:/app\n3:name=systemd:/app\n"
    assert _cgroup(tmp_path, membership, files) == 1.5


def test_a_line_that_is_not_a_membership_is_skipped(tmp_path: Path) -> None:
    assert _cgroup(tmp_path, "garbage\n\n0::/\n", {"cpu.max": "100000 100000\n"}) == 1.0


def test_no_quota_anywhere_is_no_limit(tmp_path: Path) -> None:
    assert _cgroup(tmp_path, "0::/a/b\n", {"a/b/cpu.max": "max 100000\n"}) is None
    assert _cgroup(tmp_path, "0::/a\n", {}) is None
    assert cgroup_cpu_limit(tmp_path / "none", tmp_path / "no-membership") is None


def test_v1_the_cpu_controller_quota(tmp_path: Path) -> None:
    files = {"cpu,cpuacct/app/cpu.cfs_quota_us": "250000\n",
             "cpu,cpuacct/app/cpu.cfs_period_us": "100000\n"}
    assert _cgroup(tmp_path, "4:cpu,cpuacct:/app\n1:name=systemd:/app\n", files) == 2.5
    files["cpu,cpuacct/app/cpu.cfs_quota_us"] = "-1\n"
    assert _cgroup(tmp_path, "4:cpu,cpuacct:/app\n", files) is None


def test_an_explicit_count_the_connections_cannot_hold_is_refused_with_the_fix() -> None:
    assert fit_workers(4, Settings(workers=4, pool_max=20), 97) == (4, None)  # 4 x 22 = 88
    count, why = fit_workers(8, Settings(workers=8, pool_max=20), 97)
    assert count == 0
    assert why is not None and "176 connections" in why and "lower workers or pool_max" in why


def test_the_default_count_is_lowered_to_what_fits_and_never_below_one() -> None:
    count, why = fit_workers(8, Settings(pool_max=20), 97)
    assert count == 4 and why is not None and why.endswith("starting 4")
    assert fit_workers(8, Settings(pool_max=200), 97)[0] == 1


def test_behind_a_transaction_pooler_only_a_workers_own_connections_count() -> None:
    pooled = Settings(workers=8, pool_max=50, pooler="transaction")
    assert fit_workers(8, pooled, 20) == (8, None)
    assert fit_workers(8, pooled, 15)[0] == 0
