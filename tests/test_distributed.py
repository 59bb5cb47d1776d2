"""strategy=ddp for real: 2-rank gloo jobs in subprocesses, under torchrun and self-launched."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import assert_same_weights, checkpoint_weights, run_cli, train_in_process

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# An MLP without dropout, SGD: one process with batch 2B must equal 2 ranks with batch B each.
# 129 validation samples: not divisible by 2, so padding would show up as double counting.
MLP = [
    "model=mlp", "data.num_features=24", "data.num_samples=512", "data.num_val_samples=129",
    "model.hidden_sizes=[16]", "optimizer=sgd", "optimizer.lr=0.05", "optimizer.momentum=0.9",
    "trainer.seed=7",
]


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_ddp_two_ranks_batch_b_matches_single_process_batch_2b(tmp_path):
    _ok(run_cli(MLP + ["strategy=ddp", "trainer.batch_size=16", "trainer.max_steps=20",
                       f"hydra.run.dir={tmp_path / 'ddp'}"], launcher=TORCHRUN))
    single = train_in_process(MLP + ["trainer.batch_size=32", "trainer.max_steps=20"], tmp_path / "single")
    assert_same_weights(checkpoint_weights(tmp_path / "ddp"), checkpoint_weights(tmp_path / "single"), atol=1e-5)
    # The all-reduced validation metrics equal the single-process ones: no double counting.
    ddp_metrics = json.loads((tmp_path / "ddp" / "metrics.json").read_text())["final"]
    for key, value in single.metrics.items():
        assert ddp_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_ddp_with_accumulation_matches_single_process_big_batch(tmp_path):
    _ok(run_cli(MLP + ["strategy=ddp", "trainer.batch_size=8", "trainer.accumulate_grad_batches=2",
                       "trainer.max_steps=12", f"hydra.run.dir={tmp_path / 'ddp'}"], launcher=TORCHRUN))
    train_in_process(MLP + ["trainer.batch_size=32", "trainer.max_steps=12"], tmp_path / "single")
    assert_same_weights(checkpoint_weights(tmp_path / "ddp"), checkpoint_weights(tmp_path / "single"), atol=1e-5)


def test_self_launched_ddp_resume_equals_uninterrupted(tmp_path):
    common = MLP + ["strategy=ddp", "strategy.nproc_per_node=2", "trainer.batch_size=16"]
    _ok(run_cli(common + ["trainer.max_steps=30", f"hydra.run.dir={tmp_path / 'straight'}"]))
    _ok(run_cli(common + ["trainer.max_steps=13", f"hydra.run.dir={tmp_path / 'first'}"]))
    _ok(run_cli(common + ["trainer.max_steps=30", f"trainer.resume={tmp_path / 'first/checkpoints/last.pt'}",
                          f"hydra.run.dir={tmp_path / 'second'}"]))
    straight, resumed = checkpoint_weights(tmp_path / "straight"), checkpoint_weights(tmp_path / "second")
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key


def test_torchrun_job_writes_one_run_dir_from_rank_0_only(tmp_path):
    proc = _ok(run_cli(["strategy=ddp", "trainer.max_epochs=1", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=tmp_path, launcher=TORCHRUN))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], "another rank wrote a directory"
    run = tmp_path / "run"
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.pt", "last.pt"]
    assert proc.stdout.count("learned w=") + proc.stderr.count("learned w=") == 1


@pytest.mark.parametrize("flag", [["--local-rank=0"], ["--local_rank", "0"]])
def test_legacy_local_rank_argument_is_accepted(tmp_path, flag):
    proc = run_cli(flag + ["trainer.max_steps=3", f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_nccl_without_cuda_fails_clearly_on_every_rank(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = run_cli(["strategy=ddp", "strategy.backend=nccl", f"hydra.run.dir={tmp_path}"], launcher=TORCHRUN)
    assert proc.returncode != 0
    assert proc.stderr.count("error: strategy.backend=nccl needs a CUDA device") == 2


def test_more_ranks_than_samples_fails_clearly(tmp_path):
    proc = run_cli(["strategy=ddp", "data.num_samples=1", f"hydra.run.dir={tmp_path}"], launcher=TORCHRUN)
    assert proc.returncode != 0
    assert proc.stderr.count("error: the training set has 1 samples but 2 processes") == 2


def test_multirun_under_torchrun_is_refused(tmp_path):
    proc = run_cli(["-m", "optimizer.lr=0.1,0.01", f"hydra.sweep.dir={tmp_path}"], launcher=TORCHRUN)
    assert proc.returncode != 0
    assert "multirun (-m) under torchrun" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_dp_on_cpu_warns_and_trains(tmp_path):
    proc = _ok(run_cli(["strategy=dp", "trainer.max_epochs=1", f"hydra.run.dir={tmp_path}"]))
    assert "strategy=dp needs 2 or more CUDA GPUs" in proc.stdout + proc.stderr
    weights = checkpoint_weights(tmp_path)
    assert list(weights) == ["linear.weight", "linear.bias"]
