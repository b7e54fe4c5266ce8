"""The client library, every non-UI agenttui module and the whole agentd package load without
Textual (scripts and the daemon must not pay for, or depend on, the UI)."""

from __future__ import annotations

import json
import subprocess
import sys

NON_UI = ["agenttui", "agenttui.client", "agenttui.models", "agenttui.conversation",
          "agenttui.settings", "agenttui.locations", "agenttui.drafts", "agenttui.ask",
          "agenttui.cli"]

PROBE = """
import importlib, json, pkgutil, sys
import agentd
names = list(sys.argv[1:])
names += [m.name for m in pkgutil.walk_packages(agentd.__path__, "agentd.")
          if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"imported": names,
                  "textual": sorted(m for m in sys.modules if m.split(".")[0] == "textual")}))
"""


def probe(*modules: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def test_client_library_and_agentd_never_import_textual() -> None:
    result = probe(*NON_UI)
    assert "agentd.api.routes" in result["imported"] and "agentd.runtime" in result["imported"]
    assert result["textual"] == []


def test_the_probe_does_see_textual_when_the_ui_loads() -> None:
    assert "textual.app" in probe("agenttui.app")["textual"]
