"""SQL only in the data layer: the short list of modules that may import agentd.queries.

HTTP handlers, tools, health and metrics call functions of these modules (through the service
layer where there is one); none of them sees a statement.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

DATA_LAYER = {
    "agentd.db": "connections and the server-level probes (ping, clock, version)",
    "agentd.migrate": "the migration ledger",
    "agentd.accounts": "accounts, devices and their tokens",
    "agentd.conversations": "conversation state, presence and the notebook",
    "agentd.queue": "the run lifecycle: enqueue, claim, fenced writes, finish, reap, stop",
    "agentd.approvals": "tool approvals: the worker's fenced question, a device's decision",
    "agentd.statistics": "planner statistics of the hot tables while they are young",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(path: Path) -> str:
    """What a relative import in this file is relative to."""
    return ".".join(path.relative_to(SRC).parts[:-1])


def imports_queries(source: str, package: str) -> bool:
    """Whether a module imports agentd.queries, in any spelling (absolute or relative)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            if any(alias.name == "agentd.queries" for alias in node.names):
                return True
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base == "agentd.queries" or (
                    base == "agentd" and any(a.name == "queries" for a in node.names)):
                return True
    return False


def test_only_the_data_layer_imports_the_statements() -> None:
    importers = {module_name(path) for path in SRC.rglob("*.py")
                 if imports_queries(path.read_text("utf-8"), package_of(path))}
    assert importers - set(DATA_LAYER) == set(), "SQL outside the data layer"
    assert len(importers) >= 4  # the scan itself found the data layer
    for module in DATA_LAYER:
        assert (SRC / module.replace(".", "/")).with_suffix(".py").exists(), module


def test_the_import_check_sees_every_spelling() -> None:
    assert imports_queries("from agentd.queries import Q", "agentd.api")
    assert imports_queries("import agentd.queries", "agentd.tools")
    assert imports_queries("from agentd import queries", "agentd.api")
    assert imports_queries("from ..queries import Q", "agentd.api")
    assert imports_queries("from . import queries", "agentd")
    assert imports_queries("def f():\n    from agentd.queries import Q\n", "agentd")
    assert not imports_queries("from agentd.queue import claim_runs", "agentd.api")
    assert not imports_queries("from agentd import queue", "agentd.api")
    assert not imports_queries("from . import queries", "agentd.api")
