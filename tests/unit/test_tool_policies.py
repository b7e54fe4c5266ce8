"""`[tools]` names built-in tools only: a typo there left the tool it meant at `auto`."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentd.settings import SettingsError, load_settings
from agentd.tool_settings import BUILTIN_TOOLS
from agentd.tools import default_tools


def test_the_built_in_names_are_the_built_in_tools() -> None:
    assert default_tools().names() == BUILTIN_TOOLS


@pytest.mark.parametrize("key", ["note", '"time.convert_time"'])
def test_a_policy_for_no_built_in_tool_is_refused_naming_it(tmp_path: Path, key: str) -> None:
    config = tmp_path / "agentd.toml"
    config.write_text(f'[tools]\n{key} = "deny"\n')
    with pytest.raises(SettingsError, match="no built-in tool has this name") as refused:
        load_settings(config, env={})
    assert key.strip('"') in str(refused.value) and "[mcp.<name>]" in str(refused.value)


def test_policies_for_built_in_tools_are_taken(tmp_path: Path) -> None:
    config = tmp_path / "agentd.toml"
    config.write_text('[tools]\nnotes = "deny"\ncalculator = "ask"\n')
    policies = load_settings(config, env={}).tool_policies
    assert {name: str(p) for name, p in policies.items()} == {"notes": "deny",
                                                               "calculator": "ask"}
