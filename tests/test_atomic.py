"""A file replaced through ringtrain.storage is the old one or the new one, never debris.

The checkpoint-specific guarantees (full disks, one-line errors, fsync order) are in
tests/test_checkpoint_files.py; these are the helper's own, for every other file it writes.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from ringtrain.storage import open_atomically, temp_name_pattern, temp_path, write_text_atomically


def test_missing_directories_are_created_and_the_file_replaced(tmp_path):
    target = tmp_path / "new" / "dir" / "meta.json"
    write_text_atomically(target, "first")
    write_text_atomically(target, "second é")

    assert target.read_text(encoding="utf-8") == "second é"
    assert os.listdir(target.parent) == ["meta.json"]


def test_an_error_inside_the_block_keeps_the_previous_file_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "metrics.json"
    write_text_atomically(target, "kept")

    with pytest.raises(ValueError, match="serializer failed"):
        with open_atomically(target) as file:
            file.write(b"half of it")
            raise ValueError("serializer failed")

    assert target.read_text() == "kept"
    assert os.listdir(tmp_path) == ["metrics.json"]


def test_a_leftover_temp_file_that_links_to_another_file_is_not_written_through(tmp_path):
    # A save killed between linking last.pt's temp name and renaming it, in a process whose pid
    # this one now has: writing into that name must not truncate the file it links to.
    step_file = tmp_path / "step-00000010.pt"
    step_file.write_bytes(b"a checkpoint")
    os.link(step_file, temp_path(tmp_path / "last.pt"))

    write_text_atomically(tmp_path / "last.pt", "new")

    assert step_file.read_bytes() == b"a checkpoint"
    assert sorted(os.listdir(tmp_path)) == ["last.pt", "step-00000010.pt"]


def test_temp_name_pattern_recognises_temp_path_names_only():
    pattern = temp_name_pattern(r"last\.pt|step-\d+\.pt")
    assert pattern.match(temp_path(Path("/run/last.pt")).name)
    assert pattern.match(temp_path(Path("step-00000010.pt")).name)
    assert not pattern.match(temp_path(Path("notes.txt")).name)
    assert not pattern.match("last.pt.tmp-12")  # not hidden: not a name temp_path makes
