"""strategy=ddp for real: 2-rank gloo jobs in subprocesses, under torchrun and self-launched."""
from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
import time

import pytest
import torch

from conftest import REPO, assert_same_weights, checkpoint_weights, run_cli, train_in_process
from helpers import TORCHRUN, free_port, ok
from ringtrain.callbacks import Callback

# An MLP without dropout, SGD: one process with batch 2B must equal 2 ranks with batch B each.
# 129 validation samples: not divisible by 2, so padding would show up as double counting.
MLP = [
    "model=mlp", "data.num_features=24", "data.num_samples=512", "data.num_val_samples=129",
    "model.hidden_sizes=[16]", "optimizer=sgd", "optimizer.lr=0.05", "optimizer.momentum=0.9",
    "trainer.seed=7",
]


def test_ddp_two_ranks_batch_b_matches_single_process_batch_2b(tmp_path):
    ok(run_cli(MLP + ["strategy=ddp", "trainer.batch_size=16", "trainer.max_steps=20",
                      f"hydra.run.dir={tmp_path / 'ddp'}"], launcher=TORCHRUN))
    single = train_in_process(MLP + ["trainer.batch_size=32", "trainer.max_steps=20"], tmp_path / "single")
    assert_same_weights(checkpoint_weights(tmp_path / "ddp"), checkpoint_weights(tmp_path / "single"), atol=1e-5)
    # The all-reduced validation metrics equal the single-process ones: no double counting.
    ddp_metrics = json.loads((tmp_path / "ddp" / "metrics.json").read_text())["final"]
    for key, value in single.metrics.items():
        assert ddp_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.slow
def test_ddp_with_accumulation_matches_single_process_big_batch(tmp_path):
    ok(run_cli(MLP + ["strategy=ddp", "trainer.batch_size=8", "trainer.accumulate_grad_batches=2",
                      "trainer.max_steps=12", f"hydra.run.dir={tmp_path / 'ddp'}"], launcher=TORCHRUN))
    train_in_process(MLP + ["trainer.batch_size=32", "trainer.max_steps=12"], tmp_path / "single")
    assert_same_weights(checkpoint_weights(tmp_path / "ddp"), checkpoint_weights(tmp_path / "single"), atol=1e-5)


@pytest.mark.slow
def test_self_launched_ddp_resume_equals_uninterrupted(tmp_path):
    common = MLP + ["strategy=ddp", "strategy.nproc_per_node=2", "trainer.batch_size=16"]
    ok(run_cli(common + ["trainer.max_steps=30", f"hydra.run.dir={tmp_path / 'straight'}"]))
    ok(run_cli(common + ["trainer.max_steps=13", f"hydra.run.dir={tmp_path / 'first'}"]))
    ok(run_cli(common + ["trainer.max_steps=30", f"trainer.resume={tmp_path / 'first/checkpoints/last.pt'}",
                         f"hydra.run.dir={tmp_path / 'second'}"]))
    straight, resumed = checkpoint_weights(tmp_path / "straight"), checkpoint_weights(tmp_path / "second")
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key
    # Spawned ranks have no Hydra logging of their own; rank 0's log still reaches train.log.
    assert "done: 30 steps" in (tmp_path / "straight" / "train.log").read_text()


def test_torchrun_job_writes_one_run_dir_from_rank_0_only(tmp_path):
    proc = ok(run_cli(["strategy=ddp", "trainer.max_epochs=1", f"hydra.run.dir={tmp_path / 'run'}"],
                      cwd=tmp_path, launcher=TORCHRUN))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], "another rank wrote a directory"
    run = tmp_path / "run"
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
    # 1 epoch of 10000 / (2 * 32) = 157 steps, one evaluation: one step file, last.pt, best.pt
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.pt", "last.pt", "step-00000157.pt"]
    assert proc.stdout.count("learned w=") + proc.stderr.count("learned w=") == 1
    assert (run / "train.log").read_text().count("learned w=") == 1


@pytest.mark.parametrize("flag", [["--local-rank=0"], pytest.param(["--local_rank", "0"], marks=pytest.mark.slow)])
def test_legacy_local_rank_argument_is_accepted(tmp_path, flag):
    proc = run_cli(flag + ["trainer.max_steps=3", f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_nccl_without_cuda_fails_clearly_once_for_the_job(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = run_cli(["strategy=ddp", "strategy.backend=nccl", f"hydra.run.dir={tmp_path}"], launcher=TORCHRUN)
    assert proc.returncode != 0
    # Every rank meets it; the first to report it says it (ringtrain/errors.py).
    assert proc.stderr.count("error: strategy.backend=nccl needs a CUDA device") == 1


@pytest.mark.parametrize("split,key", [("training", "data.num_samples"), pytest.param("validation", "data.num_val_samples", marks=pytest.mark.slow)])
def test_more_ranks_than_samples_fails_clearly(tmp_path, split, key):
    # A rank without validation samples used to leave the all-reduce of the metrics hanging.
    proc = run_cli(["strategy=ddp", f"{key}=1", f"hydra.run.dir={tmp_path}"], launcher=TORCHRUN, timeout=120)
    assert proc.returncode != 0
    # Both ranks meet it; the first to report it says it, once for the job.
    assert proc.stderr.count(f"error: the {split} set has 1 samples but 2 processes") == 1


def test_multirun_under_torchrun_is_refused(tmp_path):
    proc = run_cli(["-m", "optimizer.lr=0.1,0.01", f"hydra.sweep.dir={tmp_path}"], launcher=TORCHRUN)
    assert proc.returncode != 0
    assert "multirun (-m) under torchrun" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_dp_on_cpu_warns_and_trains(tmp_path):
    proc = ok(run_cli(["strategy=dp", "trainer.max_epochs=1", f"hydra.run.dir={tmp_path}"]))
    assert "strategy=dp needs 2 or more CUDA GPUs" in proc.stdout + proc.stderr
    weights = checkpoint_weights(tmp_path)
    assert list(weights) == ["linear.weight", "linear.bias"]


# --- the DDP wrapper and gradient synchronisation, on a real 1-rank gloo group -------------


@pytest.fixture
def one_rank_group(monkeypatch):
    """Launcher variables for a 1-rank job in this process: strategy=ddp really wraps in DDP."""
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)


def syncs_buffers(ddp) -> bool:
    """DDP's flag under torch 2.13's name, or the older name (torch 2.11 knows only that one)."""
    return ddp.forward_sync_buffers if hasattr(ddp, "forward_sync_buffers") else ddp.broadcast_buffers


def test_ddp_wrapper_takes_every_option_from_the_strategy_config(one_rank_group):
    import torch.distributed as dist
    from ringtrain.config.schema import validate
    from ringtrain.distributed import join_process_group, teardown_distributed
    from conftest import compose_config

    run = validate(compose_config([
        "strategy=ddp", "strategy.bucket_cap_mb=7.5", "strategy.find_unused_parameters=true",
        "strategy.gradient_as_bucket_view=false", "strategy.static_graph=true",
        "strategy.forward_sync_buffers=false",
    ]))
    info = join_process_group("auto", "cpu", 1.0)
    try:
        assert dist.get_backend() == "gloo" and info.world_size == 1
        with warnings.catch_warnings():  # no deprecation warning on any rank
            warnings.simplefilter("error", FutureWarning)
            ddp = run.strategy.wrap(torch.nn.Linear(2, 2), info)
        assert ddp.bucket_bytes_cap == int(7.5 * 1024 * 1024)
        assert ddp.find_unused_parameters and not ddp.gradient_as_bucket_view
        assert ddp.static_graph and not syncs_buffers(ddp)
        defaults = validate(compose_config(["strategy=ddp"])).strategy.wrap(torch.nn.Linear(2, 2), info)
        assert defaults.bucket_bytes_cap == 25 * 1024 * 1024 and syncs_buffers(defaults)
        assert not defaults.find_unused_parameters and defaults.gradient_as_bucket_view
    finally:
        teardown_distributed()


# Each rank wraps a model whose buffer starts at 10 * (rank + 1) and adds each input (rank + 1)
# in forward, under strategy.forward_sync_buffers=true, then false, and writes the buffer after
# the wrap and after each of two training steps to <argv[1]>/rank-<R>.json.
BUFFERS_WORKER = """
import json, sys, warnings
import torch
from torch import nn
from ringtrain.config.schema import strategy_option
from ringtrain.distributed import join_process_group, teardown_distributed

class Seen(nn.Module):
    def __init__(self, start):
        super().__init__()
        self.linear = nn.Linear(1, 1)
        self.register_buffer("seen", torch.tensor(start))

    def forward(self, x):
        self.seen += x.sum()
        return self.linear(x)

info = join_process_group("gloo", "cpu", 1.0)
warnings.simplefilter("error", FutureWarning)  # a deprecated DDP argument fails the job
seen = {}
for sync in ("true", "false"):
    ddp = strategy_option("ddp", forward_sync_buffers=sync == "true").wrap(Seen(10.0 * (info.rank + 1)), info)
    seen[sync] = [ddp.module.seen.item()]
    for _ in range(2):
        ddp(torch.full((1, 1), info.rank + 1.0)).sum().backward()
        seen[sync].append(ddp.module.seen.item())
with open(f"{sys.argv[1]}/rank-{info.rank}.json", "w") as file:
    json.dump(seen, file)
teardown_distributed()
"""


@pytest.mark.slow
def test_forward_sync_buffers_on_two_ranks_syncs_buffers_at_every_forward_or_only_at_the_start(tmp_path):
    """strategy.forward_sync_buffers=true: every forward starts from rank 0's buffers (DDP's
    default). false: each rank's forwards change only its own buffers; at the start they are
    rank 0's on torch >= 2.13 (DDP's forward_sync_buffers=False), each rank's own before it
    (broadcast_buffers=False synced none), as strategies/ddp.py says."""
    from torch.nn.parallel import DistributedDataParallel

    script = tmp_path / "buffers.py"
    script.write_text(BUFFERS_WORKER)
    ok(subprocess.run(TORCHRUN + [str(script), str(tmp_path)], capture_output=True, text=True, timeout=300,
                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    first, second = (json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1))
    # true: rank 0's buffer (10, then 11) before each forward, plus the rank's own input.
    assert (first["true"], second["true"]) == ([10, 11, 12], [10, 12, 13])
    synced_at_start = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    assert (first["false"], second["false"]) == ([10, 11, 12], [10, 12, 14] if synced_at_start else [20, 22, 24])


def test_accumulation_all_reduces_only_on_the_last_micro_batch(one_rank_group, tmp_path, monkeypatch):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from ringtrain.strategies.ddp import DDP

    all_reduces = []

    def counting_hook(state, bucket):
        all_reduces.append(bucket.index())
        return allreduce_hook(state, bucket)

    def wrap_and_count(self, module, dist):
        wrapped = original_wrap(self, module, dist)
        wrapped.register_comm_hook(None, counting_hook)
        return wrapped

    original_wrap = DDP.wrap
    monkeypatch.setattr(DDP, "wrap", wrap_and_count)
    train_in_process(MLP + ["strategy=ddp", "trainer.batch_size=8", "trainer.accumulate_grad_batches=4",
                            "trainer.max_steps=3"], tmp_path)
    assert all_reduces == [0, 0, 0]  # one bucket, once per optimizer step, not per micro-batch


# --- whole jobs ---------------------------------------------------------------------------


@pytest.mark.slow
def test_scale_lr_by_world_size_doubles_the_lr_of_two_ranks(tmp_path):
    ok(run_cli(MLP + ["strategy=ddp", "strategy.scale_lr_by_world_size=true", "trainer.max_steps=2",
                      f"hydra.run.dir={tmp_path}"], launcher=TORCHRUN))
    state = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [pytest.approx(0.1)]  # 2 * 0.05


@pytest.mark.slow
def test_torch_distributed_launch_with_its_local_rank_argument_trains(tmp_path):
    launch = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2"]
    # It passes --local-rank=N to each worker: Hydra would refuse it as an override.
    ok(run_cli(["strategy=ddp", "trainer.max_steps=3", f"hydra.run.dir={tmp_path}"], launcher=launch))
    assert (tmp_path / "checkpoints" / "last.pt").exists()


# A failing rank's job must end within this many seconds of the failure: far below the
# collective timeout these jobs set (strategy.timeout_minutes=3), which a surviving rank that
# waited for its lost peer would hit instead. Measured from the failure itself, an event
# recorded by the failing rank, not from the job's start: two ranks starting on a loaded
# machine took over 60 s before training began.
ENDS_WITHIN_SECONDS = 60
FAILING = ["strategy=ddp", "trainer.max_steps=50", "strategy.timeout_minutes=3"]


class FailOnRank1AtStep3(Callback):
    """Rank 1 raises as its third optimizer step ends, having written the moment it did
    (time.monotonic(): one clock for every process on the machine) to `failed_at`."""

    def __init__(self, failed_at: str):
        self.failed_at = failed_at

    def on_step_end(self, run, end) -> None:
        if run.dist.rank == 1 and end.step == 3:
            Path(self.failed_at).write_text(repr(time.monotonic()))
            raise RuntimeError("rank 1 broke at step 3")


def failing(failed_at: Path) -> list[str]:
    return FAILING + [f"+callbacks.fail._target_={__name__}.FailOnRank1AtStep3", f"+callbacks.fail.failed_at={failed_at}"]


def seconds_since_the_failure(failed_at_file: Path) -> float:
    return time.monotonic() - float(failed_at_file.read_text())


def test_a_rank_failing_mid_training_under_torchrun_ends_the_job_quickly(tmp_path):
    failed_at = tmp_path / "rank-1-failed-at"
    proc = subprocess.run(TORCHRUN + [str(REPO / "train.py"), *MLP, *failing(failed_at), f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "tests")})
    assert proc.returncode != 0
    assert "rank 1 broke at step 3" in proc.stderr
    ended_after = seconds_since_the_failure(failed_at)
    print(f"the job ended {ended_after:.1f} s after rank 1 failed")
    assert ended_after < ENDS_WITHIN_SECONDS, f"the job ended {ended_after:.0f} s after rank 1 failed"
    assert not (tmp_path / "run" / "checkpoints").exists()  # no half-trained checkpoint


@pytest.mark.slow
def test_a_rank_failing_mid_training_in_a_self_launched_job_ends_it_quickly(tmp_path, capfd):
    from conftest import compose_config
    from ringtrain.config.schema import validate
    from ringtrain.distributed import WorkerFailedError
    from ringtrain.run import train_rank
    from ringtrain.strategies.launch import launch_ranks

    run = validate(compose_config(MLP + failing(tmp_path / "rank-1-failed-at")))
    with pytest.raises(WorkerFailedError) as info:
        launch_ranks(2, train_rank, (run, str(tmp_path / "run")))
    ended_after = seconds_since_the_failure(tmp_path / "rank-1-failed-at")
    # Whichever rank is reported first: rank 1 itself, or rank 0 losing its peer; rank 1's
    # own error is in the ranks' output.
    assert re.match(r"rank [01] exited with status 1; its own output above says why", str(info.value)), str(info.value)
    assert "rank 1 broke at step 3" in capfd.readouterr().err
    assert info.value.exit_code == 1  # a crash, not a configuration mistake (2)
    print(f"the job ended {ended_after:.1f} s after rank 1 failed")
    assert ended_after < ENDS_WITHIN_SECONDS, f"the job ended {ended_after:.0f} s after rank 1 failed"
    assert not (tmp_path / "run" / "checkpoints").exists()


PEER_DIES = """
import os, sys, torch, torch.distributed as dist
from ringtrain.distributed import peer_lost
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1:
    os._exit(9)  # as a SIGKILLed or crashed worker leaves: no goodbye to its peers
try:
    dist.all_reduce(torch.ones(1))
except RuntimeError as err:
    print(peer_lost(err, dist.get_rank()), flush=True)
os._exit(0)  # a gloo group whose peer is gone aborts at interpreter exit; that is not under test
"""


def test_a_rank_whose_peer_died_gets_one_line_instead_of_gloos_traceback():
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": str(REPO)}
    ranks = [subprocess.Popen([sys.executable, "-c", PEER_DIES], env={**env, "RANK": str(r)}, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    out, err = ranks[0].communicate(timeout=120)
    ranks[1].wait(timeout=30)
    assert ranks[0].returncode == 0, err[-2000:]
    assert out.startswith("rank 0: another rank ended while this one was waiting for it ("), out + err
    assert "by peer" in out  # gloo's words vary: "Connection closed by peer", "... reset by peer"
    assert out.rstrip().endswith("its own output says why. The checkpoints are intact: the same command with "
                                 "hydra.run.dir=<this run's directory> continues from the last one")
    assert "\n" not in out.strip() and "pair.cc" not in out  # one line, without gloo's source location
