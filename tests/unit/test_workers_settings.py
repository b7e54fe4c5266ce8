"""`workers` and `pooler`: how many processes serve, and which DSN a session-bound job uses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentd.settings import SettingsError, load_settings
from agentd.supervisor import worker_count


def _load(tmp_path: Path, **env: str):
    config = tmp_path / "agentd.toml"
    config.write_text("")
    return load_settings(env={"AGENTD_CONFIG": str(config), **env})


def test_workers_default_to_one_per_core_and_an_explicit_count_wins(tmp_path: Path) -> None:
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
