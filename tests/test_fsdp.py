"""trainer/strategies/fsdp.py for real: 2-rank gloo jobs (tests/fsdp_worker.py) against one process.

Three 2-rank launches serve the whole file (module fixtures): `train` (the equivalence
cases and a step-20 checkpoint), `resume` (fsdp -> fsdp via a sharded checkpoint, and
single process -> fsdp) and `ddp_resume` (fsdp -> DDP). The single-process references run
in this process with the worker's own `train`, on a batch twice the per-rank one. The tests
of those launches are `slow` (about 5 minutes together on 2 cores); the default suite keeps
fsdp's 2-rank equivalence and one-line mistakes in tests/test_fsdp_training.py.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fsdp_worker as worker
from helpers import free_port
from ringtrain.checkpoints.state_dicts import (
    full_model_state_dict,
    full_optimizer_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
)
from ringtrain.strategies.fsdp import FSDP, NO_PROCESS_GROUP_MESSAGE, resolve_shard_classes, shard_model

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("fsdp_worker.py")


def run_two_ranks(scenario: str, out: Path, source: Path | None = None, timeout: float = 300) -> None:
    """Both ranks of `scenario` as plain subprocesses with torchrun's environment variables."""
    port = free_port()
    out.mkdir(parents=True, exist_ok=True)
    base = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(WORKER), scenario, str(out)] + ([str(source)] if source else [])
    ranks = [
        subprocess.Popen(command, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    try:
        results = [rank.communicate(timeout=timeout) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    for r, (rank, (_, stderr)) in enumerate(zip(ranks, results)):
        assert rank.returncode == 0, f"{scenario} rank {r} failed:\n{stderr[-3000:]}"


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def single_process_run(name: str, steps: int = worker.STEPS) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Case `name` in one process on the whole global batch (no accumulation): the reference."""
    optimizer_name, _, clip, _ = worker.CASES[name]
    model = worker.build_model()
    optimizer = worker.build_optimizer(model, optimizer_name)
    norms = worker.train(model, optimizer, range(steps), clip=clip)
    return model.state_dict(), norms


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


# --- the three 2-rank launches ----------------------------------------------------------------


@pytest.fixture(scope="module")
def train_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp_train")
    run_two_ranks("train", out)
    return out


@pytest.fixture(scope="module")
def single_checkpoint(tmp_path_factory) -> Path:
    """A step-20 AdamW checkpoint written by one process with no process group."""
    out = tmp_path_factory.mktemp("single")
    model = worker.build_model()
    optimizer = worker.build_optimizer(model, "adamw")
    worker.train(model, optimizer, range(worker.RESUME_STEP))
    torch.save({"model": full_model_state_dict(model), "optimizer": full_optimizer_state_dict(model, optimizer)},
               out / "single_step20.pt")
    return out


@pytest.fixture(scope="module")
def resume_dir(tmp_path_factory, train_dir, single_checkpoint) -> Path:
    (train_dir / "single_step20.pt").write_bytes((single_checkpoint / "single_step20.pt").read_bytes())
    out = tmp_path_factory.mktemp("fsdp_resume")
    run_two_ranks("resume", out, source=train_dir)
    return out


@pytest.fixture(scope="module")
def ddp_dir(tmp_path_factory, train_dir) -> Path:
    out = tmp_path_factory.mktemp("ddp_resume")
    run_two_ranks("ddp_resume", out, source=train_dir)
    return out


# --- two ranks with batch B equal one process with batch 2B -----------------------------------


@pytest.mark.parametrize(
    "case, atol",
    [("sgd", 1e-5), ("adamw", 1e-4), ("sgd_accumulate", 1e-5), ("sgd_cpu_offload", 1e-5)],
)
@pytest.mark.slow
def test_fsdp_two_ranks_match_single_process_double_batch(train_dir, case, atol):
    reference, _ = single_process_run(case)
    diff = max_diff(load(train_dir / f"{case}.pt"), reference)
    assert diff <= atol, f"{case}: max abs param diff {diff}"


@pytest.mark.slow
def test_accumulation_skips_the_reduce_scatter_until_the_last_micro_batch(train_dir):
    report = json.loads((train_dir / "report.json").read_text())
    early = report["sgd_accumulate"]["early_gradients"]
    # Reduce-scattering would have written the sharded .grad: it stays empty until the last.
    assert len(early) == worker.STEPS and not any(early)


@pytest.mark.slow
def test_fsdp_adamw_is_bit_identical_to_one_process_summing_the_same_halves(train_dir):
    # Each rank's half as a micro-batch of one process: the same sums in the same order, and
    # one thread, as each rank has (more threads split the matmuls' sums differently).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = worker.build_model()
        optimizer = worker.build_optimizer(model, "adamw")
        worker.train(model, optimizer, range(worker.STEPS), micro_batches=2)
    finally:
        torch.set_num_threads(threads)
    assert max_diff(load(train_dir / "adamw.pt"), model.state_dict()) <= 1e-7


@pytest.mark.slow
def test_fsdp_clipping_uses_the_global_norm(train_dir):
    reference, reference_norms = single_process_run("sgd_clip")
    norms = json.loads((train_dir / "report.json").read_text())["sgd_clip"]["norms"]
    assert min(norms) > 5 * worker.CLIP, "clipping must bite at every step for this test to mean anything"
    # The norm of the full gradient, not of rank 0's shard (which would be about 1/sqrt(2) of it).
    assert norms == pytest.approx(reference_norms, rel=1e-5)
    assert max_diff(load(train_dir / "sgd_clip.pt"), reference) <= 1e-5


@pytest.mark.slow
def test_bf16_param_dtype_computes_in_bf16_and_keeps_float32_shards(train_dir):
    report = json.loads((train_dir / "report.json").read_text())
    assert report["bf16_param_dtypes"] == ["torch.float32"]  # the sharded (optimizer's) copy
    assert report["bf16_output_dtype"] == "torch.float32"  # logits for the loss, as under autocast
    reference, _ = single_process_run("sgd", steps=worker.BF16_STEPS)
    diff = max_diff(load(train_dir / "sgd_bf16.pt"), reference)
    assert 0 < diff <= 1e-2, f"bf16 compute should differ a little from float32, not by {diff}"


# --- checkpoints --------------------------------------------------------------------------------


@pytest.mark.slow
def test_fsdp_full_state_loads_into_a_bare_transformer(train_dir):
    state = load(train_dir / "adamw_step20.pt")  # weights_only=True: plain tensors and data only
    bare = worker.build_model()
    assert state["model"].keys() == bare.state_dict().keys()  # no module. / _orig_mod. prefixes
    bare.load_state_dict(state["model"], strict=True)
    assert bare.lm_head.weight is bare.token_embedding.weight
    assert torch.equal(state["model"]["lm_head.weight"], state["model"]["token_embedding.weight"])
    # Name-keyed optimizer state: every parameter once (the tied one under its first name).
    names = [name for name, _ in bare.named_parameters()]
    assert sorted(state["optimizer"]["state"]) == sorted(names)
    assert sorted(sum((g["params"] for g in state["optimizer"]["param_groups"]), [])) == sorted(names)
    assert all(t.device.type == "cpu" and type(t) is torch.Tensor
               for s in state["optimizer"]["state"].values() for t in s.values())


@pytest.mark.slow
def test_fsdp_resume_equals_uninterrupted_and_sharded_checkpoint_round_trips(train_dir, resume_dir):
    uninterrupted, resumed = load(train_dir / "adamw.pt"), load(resume_dir / "fsdp_resumed.pt")
    for key in uninterrupted:
        assert torch.equal(uninterrupted[key], resumed[key]), key
    report = json.loads((resume_dir / "report.json").read_text())
    # The second save replaced the first (an untrained model) under the same name.
    assert report["sharded_same"], "load_sharded did not restore the saved model and optimizer exactly"
    assert report["leftovers"] == [], "a temporary checkpoint directory was left behind"


@pytest.mark.slow
def test_single_process_checkpoint_resumes_under_fsdp(resume_dir):
    reference, _ = single_process_run("adamw")
    assert max_diff(load(resume_dir / "single_to_fsdp.pt"), reference) <= 1e-4


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_under_ddp_and_ddp_state_loads_in_one_process(train_dir, ddp_dir):
    checkpoint = load(ddp_dir / "ddp_resumed.pt")
    assert max_diff(checkpoint["model"], load(train_dir / "adamw.pt")) <= 1e-4
    # DDP's full state, written without the module. prefix, loads into a plain model and optimizer.
    model = worker.build_model()
    optimizer = worker.build_optimizer(model, "adamw")
    load_full_model_state_dict(model, checkpoint["model"])
    load_full_optimizer_state_dict(model, optimizer, checkpoint["optimizer"])
    assert max_diff(model.state_dict(), checkpoint["model"]) == 0
    assert full_optimizer_state_dict(model, optimizer)["state"].keys() == checkpoint["optimizer"]["state"].keys()


def test_plain_module_helpers_round_trip_without_a_process_group():
    model = worker.build_model()
    optimizer = worker.build_optimizer(model, "adamw")
    full_optimizer_state_dict(model, optimizer)
    assert not optimizer.state, "asking a fresh optimizer for its state must not change it"
    worker.train(model, optimizer, range(3))
    weights = {k: v.clone() for k, v in full_model_state_dict(model).items()}
    optim_state = torch.load(_saved(full_optimizer_state_dict(model, optimizer)), weights_only=True)

    copy = worker.build_model()
    copy_optimizer = worker.build_optimizer(copy, "adamw")
    load_full_model_state_dict(copy, weights)
    load_full_optimizer_state_dict(copy, copy_optimizer, optim_state)
    worker.train(model, optimizer, range(3, 6))
    worker.train(copy, copy_optimizer, range(3, 6))
    assert max_diff(model.state_dict(), copy.state_dict()) == 0
    assert FSDP.total_norm([p.grad for p in model.parameters() if p.grad is not None]).item() == 0  # none left: the norm of nothing


def _saved(state: dict) -> io.BytesIO:
    """`state` through torch.save and back: what a checkpoint file holds."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


# --- errors ---------------------------------------------------------------------------------------


def test_fsdp_without_a_process_group_says_how_to_start_one():
    with pytest.raises(ValueError) as error:
        shard_model(worker.build_model(), torch.device("cpu"))
    assert str(error.value) == NO_PROCESS_GROUP_MESSAGE
    assert "torchrun" in NO_PROCESS_GROUP_MESSAGE and "strategy=single" in NO_PROCESS_GROUP_MESSAGE


def test_model_without_parameters_is_refused():
    with pytest.raises(ValueError, match="has no parameters.*strategy=single"):
        shard_model(nn.Sequential(nn.ReLU()), torch.device("cpu"))


def test_shard_class_names_resolve_or_list_what_exists():
    model = worker.build_model()
    from ringtrain.models.transformer import MLP, Block

    assert resolve_shard_classes(model, ["Block"]) == (Block,)
    assert resolve_shard_classes(model, ["ringtrain.models.transformer.Block", "MLP"]) == (Block, MLP)
    with pytest.raises(ValueError) as error:
        resolve_shard_classes(model, ["TransformerBlock"])
    message = str(error.value)
    assert "\n" not in message and "'TransformerBlock'" in message and "Block, CausalSelfAttention" in message
    with pytest.raises(ValueError, match="no submodule of Transformer is a shard class"):
        shard_model(model, torch.device("cpu"), shard_classes=(nn.Conv2d,))


TINY_BENCH = ["--world-sizes", "2", "--layers", "2", "--d-model", "32", "--heads", "2", "--vocab", "64",
              "--block-size", "16"]


def _bench(script: str) -> list[list[str]]:
    """The rows of a benchmark's table (lines that start with a world size), split in words."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *TINY_BENCH], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line.split() for line in proc.stdout.splitlines() if line.split() and line.split()[0].isdigit()]


@pytest.mark.slow
def test_the_memory_benchmark_shows_fsdp_holding_half_of_ddp_at_2_ranks():
    rows = _bench("bench_memory.py")
    assert [row[:2] for row in rows] == [["2", "ddp"], ["2", "fsdp"]]
    assert float(rows[1][-1]) == pytest.approx(0.5, abs=0.02)  # fsdp/ddp, up to padding


@pytest.mark.slow
def test_the_checkpoint_benchmark_round_trips_both_ways_and_sharded_gathers_nothing():
    rows = _bench("bench_checkpoint.py")
    assert [row[:2] for row in rows] == [["2", "full"], ["2", "sharded"]]
    assert float(rows[0][2]) > 0 and float(rows[1][2]) == 0  # MiB gathered on rank 0
    assert [row[-1] for row in rows] == ["exact", "exact"]
