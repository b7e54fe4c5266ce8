"""The one-way imports hold: import-linter's contracts in pyproject.toml, run as the CI does.

agentd never imports agenttui; the client library never imports Textual; the data layer never
reaches up into the HTTP handlers or the runtime; providers never import the HTTP API.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept() -> None:
    program = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(program).exists():
        pytest.fail("lint-imports is not installed: install the test extra "
                    "(pip install -e '.[test]')")
    result = subprocess.run([program, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " kept, 0 broken" in result.stdout  # the contracts of pyproject.toml were checked
