"""train.py with every optimizer step announced and slowed down, for tests that interrupt jobs.

    python tests/interruptible_train.py <train.py's arguments>

Run it exactly like train.py (also under torchrun, also self-launched DDP: spawned workers
re-import this file as their main module, so they are patched too). After each optimizer step
every rank prints

    interruptible: rank=<rank> pid=<pid> step=<step>

and sleeps RINGTRAIN_TEST_STEP_SECONDS (default 0.05): a test can watch the output, pick the
step it interrupts at and the process to signal, and the job stays long enough to be
interrupted without burning the CPU. Sleeping changes no number: the weights are those of
plain train.py.

RINGTRAIN_TEST_HOLD_AT_STEP=N makes every rank sleep RINGTRAIN_TEST_HOLD_SECONDS (default 3)
after announcing step N instead: a test that signals the job when it sees step N then hits it
at step N even when the test itself was kept off the CPU for a while (a loaded CI machine
delivered the announcements of five steps at once).

RINGTRAIN_TEST_DISK_FULL_AFTER_BYTES=N makes the atomic writes (checkpoints, metrics.json) fail
with ENOSPC as on a file system of N bytes (for machines where a test cannot mount a small tmpfs).

RINGTRAIN_TEST_SLOW_WRITE_FROM_STEP=N holds every write of a step file of step N or later after
its bytes are written, before its fsync and rename, for RINGTRAIN_TEST_SLOW_WRITE_SECONDS
(default 600), having announced

    interruptible: writing step=<step>

so a test can act while a (background) checkpoint write is in flight, and once the file is
renamed into place and its directory fsynced, `interruptible: written step=<step>`.

RINGTRAIN_TEST_RECORD_RESTORED=<path> saves (torch.save) what every part registered with the
CheckpointManager holds right after a resumed run restored them, as a save would collect it:
a round-trip test compares it with the checkpoint it was restored from.
"""
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "train.py")
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def _announce_and_slow_down_every_step() -> None:
    import ringtrain.callbacks as callbacks

    original = callbacks.Callbacks.call
    if getattr(original, "_interruptible", False):
        return
    delay = float(os.environ.get("RINGTRAIN_TEST_STEP_SECONDS", "0.05"))
    hold_step = int(os.environ.get("RINGTRAIN_TEST_HOLD_AT_STEP", "0"))
    hold = float(os.environ.get("RINGTRAIN_TEST_HOLD_SECONDS", "3"))
    # A file whose appearance ends the hold at hold_step (an event the test makes), instead of
    # the seconds above; bounded, so a test that never makes it cannot hang the job.
    release = os.environ.get("RINGTRAIN_TEST_HOLD_UNTIL_FILE")

    def call_then_announce(self, hook, run, *args):
        original(self, hook, run, *args)
        if hook != "on_step_end":
            return
        step = args[0].step
        # One write of the whole line: the ranks share the pipe, and print() writes the text and
        # its newline separately, so two ranks' announcements ran into one line that matched
        # neither (seen on 2 ranks for every other step), and the test missed the step it waited for.
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), f"interruptible: rank={os.environ.get('RANK', '0')} pid={os.getpid()} step={step}\n".encode())
        if step == hold_step and release:
            deadline = time.monotonic() + 300
            while not os.path.exists(release) and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            time.sleep(hold if step == hold_step else delay)

    call_then_announce._interruptible = True
    callbacks.Callbacks.call = call_then_announce


def _fill_the_disk_after(limit: int) -> None:
    """Atomic writes fail with ENOSPC once they add up to `limit` bytes, minus what the
    deleted checkpoints freed: a full file system, where a test cannot mount a small one."""
    import errno

    import ringtrain.storage as atomic
    import ringtrain.checkpoints as manager

    written = {"bytes": 0}
    original_write, original_remove = atomic._ErrorRecordingWriter.write, atomic.remove_if_present

    def write(self, data):
        if written["bytes"] + len(data) > limit:
            self.error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            raise self.error
        written["bytes"] += len(data)
        return original_write(self, data)

    def remove(path):
        if os.path.exists(path) and os.stat(path).st_nlink == 1:
            written["bytes"] -= os.path.getsize(path)
        original_remove(path)

    atomic._ErrorRecordingWriter.write = write
    # Failed writes' temporary files (atomic) and rotated step files (manager) free space.
    atomic.remove_if_present = manager.remove_if_present = remove


def _announce(line: str) -> None:
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


def _slow_down_step_file_writes(from_step: int, seconds: float) -> None:
    """Hold each step file's write of `from_step` or later between its last byte and its rename."""
    import contextlib
    import re

    import ringtrain.checkpoints.files as files

    original = files.open_atomically

    @contextlib.contextmanager
    def open_then_hold(path):
        step = re.fullmatch(r"step-(\d+)\.pt", os.path.basename(path))
        held = step is not None and int(step.group(1)) >= from_step
        with original(path) as file:
            yield file
            if held:
                _announce(f"interruptible: writing step={int(step.group(1))}")
                time.sleep(seconds)
        if held:
            _announce(f"interruptible: written step={int(step.group(1))}")

    files.open_atomically = open_then_hold


def _record_restored_state(path: str) -> None:
    import torch

    from ringtrain.checkpoints import CheckpointManager

    original = CheckpointManager.restore

    def restore_then_record(self):
        original(self)
        torch.save(self.state_dict(), path)

    CheckpointManager.restore = restore_then_record


_announce_and_slow_down_every_step()
if os.environ.get("RINGTRAIN_TEST_RECORD_RESTORED"):
    _record_restored_state(os.environ["RINGTRAIN_TEST_RECORD_RESTORED"])
if os.environ.get("RINGTRAIN_TEST_SLOW_WRITE_FROM_STEP"):
    _slow_down_step_file_writes(int(os.environ["RINGTRAIN_TEST_SLOW_WRITE_FROM_STEP"]),
                                float(os.environ.get("RINGTRAIN_TEST_SLOW_WRITE_SECONDS", "600")))
if os.environ.get("RINGTRAIN_TEST_DISK_FULL_AFTER_BYTES"):
    _fill_the_disk_after(int(os.environ["RINGTRAIN_TEST_DISK_FULL_AFTER_BYTES"]))

if __name__ == "__main__":
    sys.argv[0] = TRAIN
    with open(TRAIN) as file:
        code = compile(file.read(), TRAIN, "exec")  # Hydra finds conf/ next to this file name
    exec(code, {"__name__": "__main__", "__file__": TRAIN})
