"""Checkpoints carry checksums of their contents: changed bytes are found on load, never
trained on; a checkpoint that cannot be read is never deleted, and a directory of nothing but
unreadable checkpoints is refused instead of started over.

The real jobs that fall back from a corrupted checkpoint and end bit-identical are in
tests/test_resilience.py (full, one process) and tests/test_fsdp_training.py (sharded, 2 ranks).
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_cli, run_module, train_in_process
from helpers import CheckpointStore, corrupt_file_bytes, corrupt_tensor_bytes, refused
from ringtrain.checkpoints.files import (CHECKPOINT_FORMAT, UNREADABLE_DIR, CheckpointError, Unusable, load_checkpoint,
                                         read_checkpoint, set_aside, shards_name)
from ringtrain.checkpoints import find_resumable
from ringtrain.checkpoints.sharded import save_sharded


def why_unusable(path: Path) -> str | None:
    try:
        read_checkpoint(path, mmap=True)
    except Unusable as err:
        return str(err)
    return None


def _state(step: int, numel: int = 4096) -> dict:
    """A minimal ringtrain checkpoint whose weights (16 KiB) say which step wrote it."""
    return {"format": CHECKPOINT_FORMAT, "model": {"w": torch.full((numel,), float(step))}, "optimizer": {},
            "scheduler": {}, "progress": {"step": step}, "rng": [], "job": None, "config": {}}


def _store_of_three(directory: Path) -> CheckpointStore:
    store = CheckpointStore(directory, keep_last_k=3)
    for step in (10, 20, 30):
        store.save(_state(step), step=step, best=False)
    return store


def _contents(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (relative name -> bytes)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# --- full checkpoint files ------------------------------------------------------------------


def test_changed_tensor_bytes_load_silently_in_torch_but_ringtrain_falls_back_and_refuses(tmp_path):
    _store_of_three(tmp_path)
    record = corrupt_tensor_bytes(tmp_path / "step-00000030.pt")  # last.pt too: the same file

    # torch.load does not notice: the weights it returns are simply wrong.
    loaded = torch.load(tmp_path / "last.pt", weights_only=True)["model"]["w"]
    assert not torch.equal(loaded, torch.full((4096,), 30.0))

    found = find_resumable(tmp_path)
    assert found.path == tmp_path / "step-00000020.pt"
    assert found.warnings == [
        f"checkpoint {tmp_path / 'last.pt'} (= step-00000030.pt) is corrupt: its record {record} does not match "
        f"its checksum; falling back to {tmp_path / 'step-00000020.pt'}"]
    with pytest.raises(CheckpointError) as refusal:
        load_checkpoint(tmp_path / "last.pt")
    assert str(refusal.value) == (
        f"checkpoint '{tmp_path / 'last.pt'}' is corrupt: its record {record} does not match its checksum; use "
        f"another checkpoint of that run (an older step-*.pt, or best.pt) or a copy of this one from elsewhere")


def test_a_checkpoint_saved_without_torchs_crc32_loads_unchecked(tmp_path):
    """What an older or differently configured torch wrote (a record's CRC-32 field 0) still loads."""
    torch.serialization.set_crc32_options(False)
    try:
        CheckpointStore(tmp_path, keep_last_k=1).save(_state(10), step=10, best=False)
    finally:
        torch.serialization.set_crc32_options(True)
    assert load_checkpoint(tmp_path / "last.pt")["progress"]["step"] == 10
    assert find_resumable(tmp_path).path == tmp_path / "last.pt" and not find_resumable(tmp_path).unreadable


@pytest.mark.parametrize("content,reason", [
    (b"", "is empty (0 bytes)"),
    (b"step 10, I promise\n", "is not a torch checkpoint file (torch.save writes a zip archive)"),
])
def test_an_empty_or_foreign_file_is_named_for_what_it_is(tmp_path, content, reason):
    path = tmp_path / "last.pt"
    path.write_bytes(content)
    assert why_unusable(path) == reason
    with pytest.raises(CheckpointError) as refusal:
        load_checkpoint(path)
    assert str(refusal.value) == f"checkpoint '{path}' {reason}; pass a last.pt/best.pt written by ringtrain"
    assert "_use_new_zipfile_serialization" not in str(refusal.value)


# --- sharded checkpoints -----------------------------------------------------------------------


def _save_sharded_step(store: CheckpointStore, model: torch.nn.Module, step: int) -> None:
    """What the loop does: the shards directory first, then the step file that names it."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    save_sharded(store.shards_path(step), model, torch.optim.SGD(model.parameters(), lr=0.1))
    state = {k: v for k, v in _state(step).items() if k not in ("model", "optimizer")}
    store.save({**state, "shards": shards_name(step)}, step, best=False)


def test_a_changed_shard_file_falls_back_and_is_refused(tmp_path):
    store = CheckpointStore(tmp_path, keep_last_k=2)
    model = torch.nn.Linear(64, 64)
    _save_sharded_step(store, model, 10)
    _save_sharded_step(store, model, 20)
    recorded = torch.load(tmp_path / "last.pt", weights_only=True)["shard_checksums"]
    assert sorted(recorded) == [".metadata", "__0_0.distcp"]  # every file DCP wrote
    shard = tmp_path / "step-00000020.shards" / "__0_0.distcp"
    corrupt_file_bytes(shard)

    found = find_resumable(tmp_path)
    assert found.path == tmp_path / "step-00000010.pt"
    assert found.warnings == [
        f"checkpoint {tmp_path / 'last.pt'} (= step-00000020.pt) is corrupt: its shard file {shard} does not match "
        f"its checksum; falling back to {tmp_path / 'step-00000010.pt'}"]
    with pytest.raises(CheckpointError, match=f"^checkpoint '{tmp_path / 'last.pt'}' is corrupt: its shard file"):
        load_checkpoint(tmp_path / "last.pt")

    # A step file from before checksums were recorded: its shards load unchecked.
    old = {k: v for k, v in torch.load(tmp_path / "last.pt", weights_only=True).items() if k != "shard_checksums"}
    torch.save(old, tmp_path / "old.pt")
    assert load_checkpoint(tmp_path / "old.pt")["shards"] == tmp_path / "step-00000020.shards"


# --- never deleted for being unreadable -----------------------------------------------------------


def test_unreadable_newer_step_files_are_set_aside_and_readable_ones_removed_with_the_reason(tmp_path, caplog):
    """After resuming from an older checkpoint (trainer.resume=<its step file>), the first save
    removes the newer step files of the line of training it left, except those it cannot read:
    those move into unreadable/, bytes unchanged."""
    store = _store_of_three(tmp_path)
    corrupt_tensor_bytes(tmp_path / "step-00000030.pt")
    damaged = (tmp_path / "step-00000030.pt").read_bytes()
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        store.save(_state(15), step=15, best=False)

    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        "last.pt", "step-00000010.pt", "step-00000015.pt"]
    assert (tmp_path / UNREADABLE_DIR / "step-00000030.pt").read_bytes() == damaged
    removed, aside = caplog.messages  # oldest first
    assert removed == (f"removing {tmp_path / 'step-00000020.pt'}: step 20 of the line of training this run left "
                       f"when it resumed from an older checkpoint (step 15 was just saved in its place)")
    assert aside.startswith(f"{tmp_path / 'step-00000030.pt'} is corrupt: its record ")
    assert aside.endswith(f"; moved to {tmp_path / UNREADABLE_DIR / 'step-00000030.pt'}, not deleted")


def test_set_aside_moves_a_step_file_with_its_shards_and_never_overwrites(tmp_path):
    store = CheckpointStore(tmp_path, keep_last_k=2)
    _save_sharded_step(store, torch.nn.Linear(3, 2), 10)
    (tmp_path / UNREADABLE_DIR).mkdir()
    (tmp_path / UNREADABLE_DIR / "last.pt").write_bytes(b"set aside before")
    before = _contents(tmp_path)

    moved = set_aside([tmp_path / "last.pt", tmp_path / "step-00000010.pt"])

    assert moved == [tmp_path / UNREADABLE_DIR / "last.pt.1", tmp_path / UNREADABLE_DIR / "step-00000010.pt"]
    assert not [p for p in tmp_path.iterdir() if p.name != UNREADABLE_DIR]
    after = _contents(tmp_path / UNREADABLE_DIR)
    assert after["last.pt"] == b"set aside before" and after["last.pt.1"] == before["last.pt"]
    assert after["step-00000010.shards/__0_0.distcp"] == before["step-00000010.shards/__0_0.distcp"]


# --- real commands --------------------------------------------------------------------------------

TINY = ["model=mlp", "model.hidden_sizes=[8]", "data.num_samples=64", "data.num_val_samples=16",
        "trainer.batch_size=16", "trainer.max_steps=8", "trainer.checkpoint_every_n_steps=4", "trainer.keep_last_k=2"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A finished run: step-4.pt, step-8.pt (= last.pt), best.pt."""
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    train_in_process(TINY + [f"hydra.run.dir={run_dir}"], run_dir)
    return run_dir


def test_a_directory_of_only_unreadable_checkpoints_is_refused_and_left_as_it_is(tmp_path, tiny_run):
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir, copy_function=shutil.copy2)  # hard links become separate copies
    checkpoints = run_dir / "checkpoints"
    for name in ("last.pt", "step-00000008.pt", "best.pt"):
        corrupt_tensor_bytes(checkpoints / name)
    with open(checkpoints / "step-00000004.pt", "r+b") as file:
        file.truncate(os.path.getsize(checkpoints / "step-00000004.pt") // 2)
    before = _contents(checkpoints)

    line = refused(run_cli(TINY + [f"hydra.run.dir={run_dir}"]),
                   f"no checkpoint in {checkpoints} can be read (last.pt is corrupt: its record ",
                   "step-00000004.pt is truncated or corrupt (its zip directory is missing)",
                   "they are left as they are", "trainer.resume=null and a new hydra.run.dir",
                   "trainer.resume=<its path>")
    assert line.count("does not match its checksum") == 3  # last.pt, step-8, best.pt: each named
    assert _contents(checkpoints) == before


@pytest.mark.parametrize("tool", ["evaluate", "sample", "consolidate"])
def test_every_tool_refuses_a_corrupted_checkpoint_in_one_line(tmp_path, tiny_run, tool):
    path = tmp_path / "last.pt"
    shutil.copy(tiny_run / "checkpoints" / "last.pt", path)
    record = corrupt_tensor_bytes(path)
    refused(run_module(tool, [f"checkpoint={path}"]),
            f"checkpoint '{path}' is corrupt: its record {record} does not match its checksum")


# --- every way in: the Python API, trainer.resume=<file>, the same command (auto) ----------------
# The command line's trainer.resume=<file> with changed bytes is in tests/test_one_line_refusals.py
# (one line, exit 2, nothing on disk changed); the same command run again on a run directory whose
# last.pt has changed bytes falls back and ends bit-identical in tests/test_resilience.py.


def test_python_api_resume_from_a_file_with_changed_bytes_is_refused_before_any_step(tmp_path):
    """Trainer(resume=<last.pt>) whose weights' bytes changed on disk (zip intact, torch.load
    would return them): CheckpointError naming the record, no run directory left, the file as it was."""
    from torch import nn
    from torch.utils.data import TensorDataset

    from ringtrain import Trainer
    from ringtrain.data.tasks import RegressionTask

    x = torch.randn(64, 1, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, 2 * x + 3)

    def model() -> nn.Module:  # its 8 KiB weight matrices are the file's largest records
        return nn.Sequential(nn.Linear(1, 2048), nn.Linear(2048, 1))

    settings = dict(batch_size=16, progress_bar=False, async_checkpoint=False)
    Trainer(tmp_path / "first", max_steps=2, **settings).fit(model(), data, data, task=RegressionTask())
    last = tmp_path / "first" / "checkpoints" / "last.pt"
    written = torch.load(last, weights_only=True)["model"]
    record = corrupt_tensor_bytes(last)
    loaded = torch.load(last, weights_only=True)["model"]
    assert [name for name in written if not torch.equal(written[name], loaded[name])] == ["0.weight"]
    damaged = _contents(tmp_path)

    with pytest.raises(CheckpointError) as refusal:
        Trainer(tmp_path / "continued", max_steps=4, resume=str(last), **settings).fit(
            model(), data, data, task=RegressionTask())
    assert str(refusal.value) == (
        f"checkpoint '{last}' is corrupt: its record {record} does not match its checksum; use another checkpoint "
        f"of that run (an older step-*.pt, or best.pt) or a copy of this one from elsewhere")
    assert not (tmp_path / "continued").exists()
    assert _contents(tmp_path) == damaged
