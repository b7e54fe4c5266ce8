"""The tree passes ruff with the project's configuration (part of the one test command)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def test_ruff_check_is_clean() -> None:
    root = Path(__file__).resolve().parents[2]
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists() and shutil.which(ruff) is None:
        pytest.fail("ruff is not installed: install the test extra (pip install -e '.[test]')")
    result = subprocess.run([ruff, "check", "--quiet", "src", "tests", "bench"], cwd=root,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
