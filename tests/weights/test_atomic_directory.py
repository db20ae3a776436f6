"""``atomic_directory``: readers see the old directory or the whole new one, never a half-written one."""

from __future__ import annotations

import pytest
from rollout_engines.weights.checkpoint import atomic_directory


def test_written_in_a_sibling_then_renamed(tmp_path):
    final = tmp_path / "out"
    with atomic_directory(final) as tmp:
        assert tmp.parent == tmp_path and tmp != final and not final.exists()
        (tmp / "a.txt").write_text("a")
    assert (final / "a.txt").read_text() == "a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing left beside it


def test_a_failed_write_leaves_nothing(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_directory(final) as tmp:
        (tmp / "a.txt").write_text("half")
        raise RuntimeError("writer failed")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_directory_is_refused_or_replaced(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(FileExistsError), atomic_directory(final):
        pass
    with atomic_directory(final, replace=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
