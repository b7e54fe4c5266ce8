"""agenttui's clipboard file holds pairing lines and private answers: only its user may read it,
from the first byte on, whatever the umask and whatever file was there before."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentd import files
from agentd.files import replace_file
from agenttui.drafts import DraftLedger


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The most permissive umask: a file made with default modes would be 0666, a dir 0777."""
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.usefixtures("open_umask")
def test_the_clipboard_file_and_its_new_directory_are_private(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "agenttui" / "clipboard.txt"  # neither directory exists yet
    replace_file(path, "agenttui login https://desk:8740 --code 7K3QX-M9V2D", private_dirs=True)
    assert path.read_text("utf-8") == "agenttui login https://desk:8740 --code 7K3QX-M9V2D"
    assert mode(path) == 0o600
    assert mode(path.parent) == 0o700 and mode(path.parent.parent) == 0o700
    assert sorted(p.name for p in path.parent.iterdir()) == ["clipboard.txt"]  # no temp left


@pytest.mark.usefixtures("open_umask")
def test_a_world_readable_file_from_before_is_replaced_not_rewritten(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "clipboard.txt"
    path.write_text("an old copy", "utf-8")
    path.chmod(0o644)
    old_inode = path.stat().st_ino
    seen: list[tuple[int, str]] = []
    replace = os.replace

    def checked_replace(source: str, target: Path) -> None:
        # The moment before the new text becomes the file: it must already be private.
        seen.append((mode(Path(source)), Path(source).read_text("utf-8")))
        replace(source, target)

    monkeypatch.setattr(files.os, "replace", checked_replace)
    replace_file(path, "a private answer")
    assert seen == [(0o600, "a private answer")]
    assert path.read_text("utf-8") == "a private answer" and mode(path) == 0o600
    assert path.stat().st_ino != old_inode  # the open file was never rewritten in place


def test_temporaries_that_killed_writers_left_are_removed_once_old(tmp_path: Path) -> None:
    """A writer killed between its temporary file and the rename leaves the temporary (which
    may hold a secret): the next write removes it once it is old, and leaves a young one (a
    writer still under way) and any other file alone."""
    path = tmp_path / "config.toml"
    stale, young = tmp_path / ".config.toml.0badc0de", tmp_path / ".config.toml.1234abcd"
    unrelated = tmp_path / ".other.toml.0badc0de"
    for left in (stale, young, unrelated):
        left.write_text("token = 'secret'", "utf-8")
    long_ago = stale.stat().st_mtime - files.STALE_TEMPORARY_S - 60
    os.utime(stale, (long_ago, long_ago))
    os.utime(unrelated, (long_ago, long_ago))
    replace_file(path, "token = 'new'")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".config.toml.1234abcd", ".other.toml.0badc0de", "config.toml"])


def test_two_agenttui_keep_each_others_settled_drafts(tmp_path: Path) -> None:
    """Two agenttui on one machine share the drafts ledger: each wrote back the list it had
    read at its start, through one fixed temporary name, and erased what the other added (its
    drafts were then offered, and could be sent, again)."""
    path = tmp_path / "state" / "drafts.json"
    first, second = DraftLedger(path), DraftLedger(path)  # both started before either wrote
    first.consume(["a", "b"])
    second.consume(["c"])
    first.consume(["d"])
    assert set(DraftLedger(path)._ids) == {"a", "b", "c", "d"}
    assert "c" in first and "a" in second  # each learns the other's when it writes
    assert mode(path) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["drafts.json", "drafts.json.lock"]
