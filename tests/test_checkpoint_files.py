"""Checkpoint files survive full disks, killed saves and broken files; loading never runs code."""
from __future__ import annotations

import errno
import os
import pickle
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from helpers import CheckpointStore, remove_stale_temp_files
from ringtrain.checkpoints import find_resumable
from ringtrain.checkpoints.files import CHECKPOINT_FORMAT, CheckpointError, load_checkpoint, save_checkpoint, shards_name
from ringtrain.checkpoints.sharded import load_sharded, save_sharded


def _found(directory: Path) -> tuple:
    found = find_resumable(directory)
    return found.path, [why for _, why in found.unreadable]


def _state(step: int, numel: int = 4) -> dict:
    """A minimal ringtrain checkpoint whose weights say which step wrote it."""
    return {
        "format": CHECKPOINT_FORMAT,
        "model": {"w": torch.full((numel,), float(step))},
        "optimizer": {},
        "scheduler": {},
        "progress": {"step": step},
        "rng": [],
        "job": None,
        "config": {},
    }


def _step_of(path: Path) -> int:
    return load_checkpoint(path)["progress"]["step"]


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# --- failed writes --------------------------------------------------------------------------


def test_full_disk_keeps_the_previous_last_pt_and_leaves_no_temp_file(tmp_path, monkeypatch):
    last = tmp_path / "last.pt"
    save_checkpoint(last, _state(10))
    monkeypatch.setattr(torch, "save", _disk_full)

    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(last, _state(20))

    message = str(caught.value)
    assert message == (
        f"cannot save checkpoint {last}: No space left on device; free space on {tmp_path} "
        f"or keep fewer checkpoints; the previous last.pt is intact"
    )
    assert "\n" not in message
    assert _names(tmp_path) == ["last.pt"]
    assert _step_of(last) == 10


def test_store_full_disk_keeps_last_pt_and_writes_no_step_file(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path, keep_last_k=2)
    store.save(_state(10), step=10, best=True)
    monkeypatch.setattr(torch, "save", _disk_full)

    with pytest.raises(CheckpointError, match=r"step-00000020.pt: No space left on device; .* the previous last.pt is intact$"):
        store.save(_state(20), step=20, best=True)

    assert _names(tmp_path) == ["best.pt", "last.pt", "step-00000010.pt"]
    assert _step_of(store.last) == 10


@pytest.fixture
def tiny_tmpfs():
    """A real 1 MiB file system to fill; skipped where mounting is not allowed."""
    mount_point = Path(tempfile.mkdtemp(prefix="ringtrain-tmpfs-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True
    ).returncode == 0 if os.geteuid() == 0 else False
    if not mounted:
        mount_point.rmdir()
        pytest.skip("cannot mount a tmpfs here (needs root and mount permission)")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)
        mount_point.rmdir()


def test_really_full_file_system_keeps_the_previous_last_pt(tiny_tmpfs):
    last = tiny_tmpfs / "last.pt"
    save_checkpoint(last, _state(10, numel=1000))  # 4 kB

    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(last, _state(20, numel=500_000))  # 2 MB on a 1 MiB disk

    assert str(caught.value).startswith(f"cannot save checkpoint {last}: No space left on device; free space on {tiny_tmpfs}")
    assert _names(tiny_tmpfs) == ["last.pt"]
    assert _step_of(last) == 10


def test_a_failed_save_that_is_not_an_os_error_also_leaves_no_temp_file(tmp_path):
    with pytest.raises(Exception):
        save_checkpoint(tmp_path / "last.pt", {"model": lambda: None})  # a lambda cannot be pickled
    assert _names(tmp_path) == []


# --- durability -----------------------------------------------------------------------------


def test_file_then_rename_then_directory_are_fsynced(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def recording_replace(src, dst):
        events.append(("replace", f"{Path(src).name} -> {Path(dst).name}"))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    save_checkpoint(tmp_path / "last.pt", _state(1))

    temp = f".last.pt.tmp-{os.getpid()}"
    assert events == [
        ("fsync", str(tmp_path / temp)),
        ("replace", f"{temp} -> last.pt"),
        ("fsync", str(tmp_path)),
    ]


def test_store_links_are_made_durable_too(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))

    CheckpointStore(tmp_path, keep_last_k=1).save(_state(5), step=5, best=True)

    # The step file's data, then the directory after each of: step file, last.pt, best.pt.
    assert synced == [str(tmp_path / f".step-00000005.pt.tmp-{os.getpid()}")] + [str(tmp_path)] * 3


# --- rotation and links ---------------------------------------------------------------------


def test_keep_last_k_keeps_exactly_k_step_files_plus_last_and_best(tmp_path):
    store = CheckpointStore(tmp_path, keep_last_k=2)
    for step in (10, 20, 30, 40, 50):
        store.save(_state(step), step=step, best=step == 20)

    assert _names(tmp_path) == ["best.pt", "last.pt", "step-00000040.pt", "step-00000050.pt"]
    assert os.path.samefile(store.last, tmp_path / "step-00000050.pt")  # a link, not a copy
    assert _step_of(store.best) == 20  # its step file was rotated away; the data stayed
    assert [step for step, _ in store.step_files()] == [40, 50]


def test_keep_last_1_keeps_only_the_file_last_pt_names(tmp_path):
    store = CheckpointStore(tmp_path, keep_last_k=1)
    for step in (1, 2, 3):
        store.save(_state(step), step=step, best=False)
    assert _names(tmp_path) == ["last.pt", "step-00000003.pt"]
    assert os.path.samefile(store.last, tmp_path / "step-00000003.pt")


def test_saving_an_older_step_removes_the_newer_files_left_from_before_a_resume(tmp_path):
    store = CheckpointStore(tmp_path, keep_last_k=5)
    for step in (10, 20, 30):
        store.save(_state(step), step=step, best=False)
    store.save(_state(15), step=15, best=False)  # resumed from step 10
    assert [step for step, _ in store.step_files()] == [10, 15]
    assert _step_of(store.last) == 15


def test_links_fall_back_to_copies_where_hard_links_are_unsupported(tmp_path, monkeypatch):
    def no_links(source, target):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    (tmp_path / f".last.pt.tmp-{os.getpid()}").write_bytes(b"debris of a killed save with our pid")
    store = CheckpointStore(tmp_path, keep_last_k=1)
    store.save(_state(1), step=1, best=True)
    store.save(_state(2), step=2, best=False)

    assert _names(tmp_path) == ["best.pt", "last.pt", "step-00000002.pt"]
    assert not os.path.samefile(store.last, tmp_path / "step-00000002.pt")
    assert (_step_of(store.last), _step_of(store.best)) == (2, 1)


# --- finding a checkpoint to resume from ----------------------------------------------------


def _truncate(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as file:
        file.truncate(size // 2)


def test_truncated_newest_falls_back_to_the_previous_with_one_warning(tmp_path):
    store = CheckpointStore(tmp_path, keep_last_k=3)
    for step in (10, 20, 30):
        store.save(_state(step), step=step, best=False)
    _truncate(tmp_path / "step-00000030.pt")  # also last.pt: the same file

    found, warnings = find_resumable(tmp_path).path, find_resumable(tmp_path).warnings

    assert found == tmp_path / "step-00000020.pt"
    assert len(warnings) == 1
    assert warnings[0].startswith(f"checkpoint {tmp_path / 'last.pt'} (= step-00000030.pt) is truncated or corrupt (")
    assert warnings[0].endswith(f"; falling back to {tmp_path / 'step-00000020.pt'}")
    assert _step_of(found) == 20


def test_each_broken_file_gets_its_own_warning(tmp_path):
    store = CheckpointStore(tmp_path, keep_last_k=3)
    for step in (10, 20, 30):
        store.save(_state(step), step=step, best=False)
    store.last.unlink()
    store.last.write_bytes(b"garbage")  # last.pt broken on its own
    _truncate(tmp_path / "step-00000030.pt")

    found, warnings = find_resumable(tmp_path).path, find_resumable(tmp_path).warnings

    assert found == tmp_path / "step-00000020.pt"
    assert [w.split(" (")[0] for w in warnings] == [
        f"checkpoint {tmp_path / 'last.pt'} is not a torch checkpoint file",
        f"checkpoint {tmp_path / 'step-00000030.pt'} is truncated or corrupt",
    ]
    assert all(w.endswith(f"falling back to {tmp_path / 'step-00000020.pt'}") for w in warnings)


def test_nothing_readable_says_so(tmp_path):
    (tmp_path / "last.pt").write_bytes(b"garbage")
    found, warnings = find_resumable(tmp_path).path, find_resumable(tmp_path).warnings
    assert found is None
    assert len(warnings) == 1
    assert warnings[0].startswith(f"checkpoint {tmp_path / 'last.pt'} is not a torch checkpoint file (")
    assert warnings[0].endswith("; no readable checkpoint is left")
    assert _found(tmp_path / "missing") == (None, [])


def test_stale_temp_files_are_never_checkpoints_and_are_removed(tmp_path):
    store = CheckpointStore(tmp_path, keep_last_k=2)
    store.save(_state(10), step=10, best=False)
    # A killed save's leftovers: one even a complete, newer checkpoint; one cut short.
    save_checkpoint(tmp_path / "elsewhere.pt", _state(99))
    os.replace(tmp_path / "elsewhere.pt", tmp_path / ".step-00000099.pt.tmp-4242")
    (tmp_path / ".last.pt.tmp-4242").write_bytes(b"half a checkpoint")
    (tmp_path / ".best.pt.tmp-17").write_bytes(b"")
    # Not ringtrain's: left alone.
    (tmp_path / ".notes.txt.tmp-1").write_bytes(b"mine")
    (tmp_path / "last.pt.tmp-5").write_bytes(b"mine too")

    assert _found(tmp_path) == (tmp_path / "last.pt", [])
    removed = remove_stale_temp_files(tmp_path)

    assert [p.name for p in removed] == [".best.pt.tmp-17", ".last.pt.tmp-4242", ".step-00000099.pt.tmp-4242"]
    assert _names(tmp_path) == [".notes.txt.tmp-1", "last.pt", "last.pt.tmp-5", "step-00000010.pt"]


# --- loading never runs code ----------------------------------------------------------------


class _CreatesMarker:
    """Unpickling this calls open(marker, "w"): code run by merely loading the file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_a_pickle_that_would_run_code_is_refused_and_not_run(tmp_path, writer):
    marker = tmp_path / "code-ran"
    path = tmp_path / "last.pt"
    state = {**_state(1), "model": _CreatesMarker(marker)}
    with open(path, "wb") as file:
        torch.save(state, file) if writer == "torch.save" else pickle.dump(state, file, protocol=2)

    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path)

    message = str(caught.value)
    assert message == (
        f"checkpoint '{path}' cannot be read (loading it would run io.open, which ringtrain refuses); "
        f"pass a last.pt/best.pt written by ringtrain"
    )
    assert "\n" not in message
    assert not marker.exists()
    if writer == "torch.save":  # a resume refuses it rather than pass over it to an older file
        with pytest.raises(CheckpointError, match="would run io.open"):
            find_resumable(tmp_path)
    else:  # not a torch.save file at all: passed over as one a crash could leave
        assert find_resumable(tmp_path).path is None
    assert not marker.exists()

    # The file really is dangerous: an unrestricted load runs its code.
    with open(path, "rb") as file:
        torch.load(file, weights_only=False) if writer == "torch.save" else pickle.load(file)
    assert marker.exists()


def test_load_checkpoint_messages_are_unchanged(tmp_path):
    with pytest.raises(CheckpointError, match=r"^checkpoint '.*nope.pt' does not exist; check the path$"):
        load_checkpoint(tmp_path / "nope.pt")
    torch.save({"model": {}}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match=r"is not a ringtrain checkpoint \(missing optimizer, scheduler"):
        load_checkpoint(tmp_path / "other.pt")
    torch.save({**_state(1), "format": 99}, tmp_path / "future.pt")
    with pytest.raises(CheckpointError, match=rf"has format 99, this ringtrain reads {CHECKPOINT_FORMAT}; read it with the ringtrain version that wrote it$"):
        load_checkpoint(tmp_path / "future.pt")


# --- sharded checkpoints (strategy.state_dict_type=sharded), in one process ------------------


def _save_sharded_step(store: CheckpointStore, model: torch.nn.Module, step: int, best: bool) -> None:
    """What the loop does: the shards directory first, then the step file that names it."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_sharded(store.shards_path(step), model, optimizer)
    state = {k: v for k, v in _state(step).items() if k not in ("model", "optimizer")}
    store.save({**state, "shards": shards_name(step)}, step, best)


def _shards(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir())


def test_sharded_store_keeps_the_shards_a_checkpoint_file_names_and_no_others(tmp_path):
    store = CheckpointStore(tmp_path, keep_last_k=1)
    model = torch.nn.Linear(3, 2)
    _save_sharded_step(store, model, 10, best=True)
    _save_sharded_step(store, model, 20, best=False)
    _save_sharded_step(store, model, 30, best=False)
    # step-10's file is rotated away, but best.pt still names its shards.
    assert _shards(tmp_path) == ["step-00000010.shards", "step-00000030.shards"]
    last = load_checkpoint(tmp_path / "last.pt")
    assert "model" not in last and last["shards"] == tmp_path / "step-00000030.shards"
    bare = torch.nn.Linear(3, 2)
    load_sharded(load_checkpoint(tmp_path / "best.pt")["shards"], bare)
    assert torch.equal(bare.weight, torch.full((2, 3), 10.0))
    _save_sharded_step(store, model, 40, best=True)  # best moves on: step-10's shards go
    assert _shards(tmp_path) == ["step-00000040.shards"]


def test_sharded_checkpoint_with_incomplete_shards_falls_back_with_one_warning(tmp_path):
    store = CheckpointStore(tmp_path, keep_last_k=2)
    model = torch.nn.Linear(3, 2)
    _save_sharded_step(store, model, 10, best=False)
    _save_sharded_step(store, model, 20, best=False)
    (tmp_path / "step-00000020.shards" / ".metadata").unlink()
    found, warnings = find_resumable(tmp_path).path, find_resumable(tmp_path).warnings
    assert found == tmp_path / "step-00000010.pt"
    assert len(warnings) == 1 and "step-00000020.shards, which is missing or incomplete" in warnings[0]
    with pytest.raises(CheckpointError, match="keeps its weights in .*step-00000020.shards, which is missing"):
        load_checkpoint(tmp_path / "last.pt")


def test_shards_of_killed_saves_are_removed_and_named_ones_kept(tmp_path):
    store = CheckpointStore(tmp_path, keep_last_k=2)
    _save_sharded_step(store, torch.nn.Linear(3, 2), 10, best=False)
    (tmp_path / ".step-00000020.shards.partial").mkdir()  # killed while writing shards
    (tmp_path / ".step-00000010.shards.previous").mkdir()  # killed between the two renames
    (tmp_path / "step-00000030.shards").mkdir()  # killed after the shards, before the step file
    removed = {p.name for p in remove_stale_temp_files(tmp_path)}
    assert removed == {".step-00000020.shards.partial", ".step-00000010.shards.previous", "step-00000030.shards"}
    assert _shards(tmp_path) == ["step-00000010.shards"]
    assert _found(tmp_path) == (tmp_path / "last.pt", [])


def test_a_full_disk_during_a_sharded_save_is_one_line_and_leaves_the_last_checkpoint(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path, keep_last_k=2)
    model = torch.nn.Linear(3, 2)
    _save_sharded_step(store, model, 10, best=False)

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)  # DCP fsyncs each shard file it writes
    with pytest.raises(CheckpointError) as failure:
        save_sharded(store.shards_path(20), model, torch.optim.SGD(model.parameters(), lr=0.1))
    monkeypatch.undo()
    assert str(failure.value) == (
        f"cannot save checkpoint {tmp_path / 'step-00000020.shards'}: No space left on device; free space on "
        f"{tmp_path} or keep fewer checkpoints; the previous last.pt is intact"
    )
    assert _shards(tmp_path) == ["step-00000010.shards"]  # no partial directory left
    assert _found(tmp_path) == (tmp_path / "last.pt", [])
    assert load_checkpoint(tmp_path / "last.pt")["progress"]["step"] == 10


def test_a_sharded_save_where_no_directory_can_be_made_is_one_line(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    model = torch.nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match=r"^cannot save checkpoint .*not-a-directory/step-00000020.shards: "
                                              r"Not a directory; check that .* is writable"):
        save_sharded(blocker / shards_name(20), model, torch.optim.SGD(model.parameters(), lr=0.1))


# --- plain-format state without a process group ------------------------------------------------


def _trained(optimizer_name: str):
    """A Transformer with tied weights and AdamW groups (or SGD with momentum), two steps in."""
    from ringtrain.models.transformer import Transformer
    from ringtrain.optim import parameter_groups

    torch.manual_seed(0)
    model = Transformer(vocab_size=16, block_size=8, n_layers=2, d_model=16, n_heads=2)
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-2)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    for _ in range(2):
        tokens = torch.randint(0, 16, (4, 8))
        model(tokens).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
def test_state_without_a_process_group_is_what_dcp_gives(optimizer_name):
    """One process skips torch.distributed.checkpoint (its import costs ~0.5 s of start-up):
    the model's and optimizer's own state_dict, renamed by parameter name, must be exactly
    DCP's full format, so checkpoints stay interchangeable between strategies."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from ringtrain.checkpoints.state_dicts import full_model_state_dict, full_optimizer_state_dict

    model, optimizer = _trained(optimizer_name)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    expected_model = get_model_state_dict(model, options=options)
    expected_optimizer = get_optimizer_state_dict(model, optimizer, options=options)
    model_state, optimizer_state = full_model_state_dict(model), full_optimizer_state_dict(model, optimizer)
    assert model_state.keys() == expected_model.keys()
    assert all(torch.equal(model_state[k], expected_model[k]) for k in model_state)
    assert optimizer_state["param_groups"] == expected_optimizer["param_groups"]
    assert optimizer_state["state"].keys() == expected_optimizer["state"].keys()
    for name, values in optimizer_state["state"].items():
        assert values.keys() == expected_optimizer["state"][name].keys()
        assert all(torch.equal(torch.as_tensor(values[k]), torch.as_tensor(expected_optimizer["state"][name][k]))
                   for k in values)


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
def test_optimizer_state_loads_back_without_a_process_group(optimizer_name):
    from ringtrain.checkpoints.state_dicts import full_optimizer_state_dict, load_full_optimizer_state_dict

    model, optimizer = _trained(optimizer_name)
    saved = full_optimizer_state_dict(model, optimizer)
    fresh_model, fresh_optimizer = _trained(optimizer_name)
    for param in fresh_optimizer.state.values():
        param.clear()
    load_full_optimizer_state_dict(fresh_model, fresh_optimizer, torch.load(_saved_bytes(saved), weights_only=True))
    assert str(fresh_optimizer.state_dict()) == str(optimizer.state_dict())


def _saved_bytes(state: dict):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer
