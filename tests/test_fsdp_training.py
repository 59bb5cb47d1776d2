"""strategy=fsdp through train.py: 2 gloo ranks (self-launched and torchrun) against one process,
resume, checkpoints that load into a bare model and resume under ddp, and the refusals.

trainer/strategies/fsdp.py's own tests (tests/test_fsdp.py) hold the building blocks to the same numbers
with a hand-written loop; these hold the whole job.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_same_weights, checkpoint_weights, run_cli, run_module
from helpers import TORCHRUN, corrupt_file_bytes, ok, refused

# A Transformer without biases: a bias whose true gradient is zero gets pure rounding noise,
# which Adam scales up to full steps, and that says nothing about sharding.
SMALL = [
    "model=transformer", "model.block_size=16", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
    "model.bias=false", "data.num_train_tokens=20000", "data.num_val_tokens=1000", "data.vocab_size=16",
    "data.branching=2", "trainer.log_every_n_steps=10", "trainer.eval_every_n_steps=20",
]
FSDP_2 = ["strategy=fsdp", "strategy.nproc_per_node=2"]


def _train(tmp_path, name, overrides, launcher=None):
    ok(run_cli(SMALL + overrides + [f"hydra.run.dir={tmp_path / name}"], launcher=launcher))
    return checkpoint_weights(tmp_path / name)


@pytest.mark.parametrize("optimizer,atol", [pytest.param("sgd", 1e-5, marks=pytest.mark.slow), ("adamw", 1e-4)])
def test_fsdp_two_ranks_batch_b_match_one_process_batch_2b(tmp_path, optimizer, atol):
    common = [f"optimizer={optimizer}", "trainer.max_steps=40"]
    single = _train(tmp_path, "single", common + ["trainer.batch_size=16"])
    fsdp = _train(tmp_path, "fsdp", common + FSDP_2 + ["trainer.batch_size=8"])
    assert_same_weights(single, fsdp, atol=atol)


@pytest.mark.slow
def test_fsdp_with_accumulation_under_torchrun_matches_one_big_batch(tmp_path):
    single = _train(tmp_path, "single", ["trainer.max_steps=40", "trainer.batch_size=16"])
    fsdp = _train(tmp_path, "fsdp", ["strategy=fsdp", "trainer.max_steps=40", "trainer.batch_size=4",
                                     "trainer.accumulate_grad_batches=2"], launcher=TORCHRUN)
    assert_same_weights(single, fsdp, atol=1e-5)


# The resume tests' common settings, and their uninterrupted run (40 steps, full checkpoints).
RESUMED = FSDP_2 + ["optimizer=adamw", "trainer.batch_size=8"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[str, torch.Tensor]:
    return _train(tmp_path_factory.mktemp("fsdp"), "straight", RESUMED + ["trainer.max_steps=40"])


@pytest.mark.slow
def test_fsdp_resume_equals_uninterrupted_and_its_checkpoint_resumes_under_ddp(tmp_path, straight):
    from ringtrain.models.transformer import Transformer

    _train(tmp_path, "first", RESUMED + ["trainer.max_steps=20"])
    first_last = tmp_path / "first" / "checkpoints" / "last.pt"
    resumed = _train(tmp_path, "second", RESUMED + ["trainer.max_steps=40", f"trainer.resume={first_last}"])
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key
    # The fsdp checkpoint is plain: a bare model loads it, strictly, without torch.distributed.
    state = torch.load(first_last, weights_only=True)
    bare = Transformer(**state["data_dims"], **{k: v for k, v in state["config"]["model"].items() if k != "_target_"})
    bare.load_state_dict(state["model"])
    # ... and resumes under ddp to the same weights as fsdp all the way.
    ddp = _train(tmp_path, "ddp", ["strategy=ddp", "strategy.nproc_per_node=2", "optimizer=adamw",
                                   "trainer.batch_size=8", "trainer.max_steps=40", f"trainer.resume={first_last}"])
    assert_same_weights(straight, ddp, atol=1e-5)


@pytest.mark.slow
def test_sharded_checkpoints_resume_exactly_under_fsdp_and_ddp_and_evaluate(tmp_path, straight):
    sharded = RESUMED + ["strategy.state_dict_type=sharded", "trainer.keep_last_k=1"]
    _train(tmp_path, "run", sharded + ["trainer.max_steps=20"])
    checkpoints = tmp_path / "run" / "checkpoints"
    first = sorted(p.name for p in checkpoints.iterdir())
    # A sharded checkpoint resumes under ddp (each rank reads the whole model from the shards) ...
    ddp = _train(tmp_path, "ddp", ["strategy=ddp", "strategy.nproc_per_node=2", "optimizer=adamw",
                                   "trainer.batch_size=8", "trainer.max_steps=40",
                                   f"trainer.resume={checkpoints / 'last.pt'}"])
    assert_same_weights(straight, ddp, atol=1e-5)
    # trainer.consolidate makes one plain file of it, from which ddp continues identically.
    consolidated = tmp_path / "consolidated.pt"
    ok(run_module("ringtrain.tools.consolidate", [f"checkpoint={checkpoints / 'last.pt'}", f"output={consolidated}"]))
    assert "shards" not in torch.load(consolidated, weights_only=True)
    from_file = _train(tmp_path, "ddp-from-file", ["strategy=ddp", "strategy.nproc_per_node=2", "optimizer=adamw",
                                                   "trainer.batch_size=8", "trainer.max_steps=40",
                                                   f"trainer.resume={consolidated}"])
    for key in ddp:
        assert torch.equal(ddp[key], from_file[key]), key
    refused = run_module("ringtrain.tools.consolidate", [f"checkpoint={consolidated}"])
    assert refused.returncode == 2 and "is already one plain file" in refused.stderr
    # ringtrain export reads the shards too: the same weights as a safetensors file.
    from safetensors.torch import load_file

    exported = tmp_path / "sharded.safetensors"
    ok(run_module("ringtrain", ["export", f"checkpoint={checkpoints / 'last.pt'}", f"output={exported}"]))
    full = torch.load(consolidated, weights_only=True)["model"]
    tensors = load_file(exported)
    assert set(tensors) == set(full) - {"token_embedding.weight"}  # tied to lm_head.weight: stored once
    for key, tensor in tensors.items():
        assert torch.equal(tensor, full[key]), key
    # ... and the same command with more steps continues from it, bit for bit.
    resumed = _train(tmp_path, "run", sharded + ["trainer.max_steps=40"])
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key

    # On disk: small step files that name a directory of each rank's shards, written by DCP.
    assert first == ["best.pt", "last.pt", "step-00000020.pt", "step-00000020.shards"]
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "best.pt", "last.pt", "step-00000040.pt", "step-00000040.shards"]  # keep_last_k=1
    assert sorted(p.name for p in (checkpoints / "step-00000040.shards").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    state = torch.load(checkpoints / "last.pt", weights_only=True)
    assert "model" not in state and "optimizer" not in state and state["shards"] == "step-00000040.shards"

    # trainer.evaluate reads a sharded checkpoint in one process, to the run's own last validation.
    proc = ok(run_module("ringtrain.tools.evaluate", [f"checkpoint={checkpoints / 'last.pt'}"]))
    run_metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert proc.stdout.strip() == f"val/loss={run_metrics['final']['val/loss']:.6g}"


@pytest.mark.slow  # two 2-rank jobs, ~70 s; the default suite's variant: test_checksums.py's sharded one
def test_a_corrupted_shard_falls_back_with_one_warning_and_ends_bit_identical(tmp_path, straight):
    """Random bytes inside rank 1's shard file of the newest sharded checkpoint: its checksum
    (recorded in the step file) catches it, the same command resumes from the checkpoint before,
    and ends with the uninterrupted run's weights; the damaged checkpoint is set aside whole,
    and ringtrain consolidate refuses it in one line."""
    args = SMALL + RESUMED + ["strategy.state_dict_type=sharded", "trainer.max_steps=40",
                              "trainer.checkpoint_every_n_steps=10", f"hydra.run.dir={tmp_path / 'run'}"]
    ok(run_cli(args))
    checkpoints = tmp_path / "run" / "checkpoints"
    shard = checkpoints / "step-00000040.shards" / "__1_0.distcp"
    corrupt_file_bytes(shard)

    again = ok(run_cli(args))  # the same command again
    output = again.stdout + again.stderr
    warnings = [line for line in output.splitlines() if "does not match its checksum" in line]
    assert len(warnings) == 1, output[-4000:]
    assert f"is corrupt: its shard file {shard} does not match its checksum" in warnings[0]
    assert f"falling back to {checkpoints / 'step-00000030.pt'}" in warnings[0]
    assert f"resuming from {checkpoints / 'step-00000030.pt'} (step 30)" in output
    resumed = checkpoint_weights(tmp_path / "run")
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key

    aside = checkpoints / "unreadable"
    assert (aside / "step-00000040.shards" / "__1_0.distcp").is_file()
    refused(run_module("ringtrain.tools.consolidate", [f"checkpoint={aside / 'last.pt'}"]),
            f"checkpoint '{aside / 'last.pt'}' is corrupt: its shard file {aside / 'step-00000040.shards'}")


@pytest.mark.slow
def test_compiled_fsdp_with_accumulation_matches_eager_fsdp(tmp_path):
    """trainer.compile compiles the sharded model (graph breaks at FSDP2's hooks); gradient
    sync stays on the FSDP root, so accumulation still reduce-scatters once per step."""
    common = FSDP_2 + ["model.dropout=0.0", "optimizer.lr=0.1", "trainer.max_steps=20", "trainer.batch_size=4",
                       "trainer.accumulate_grad_batches=2"]
    proc = ok(run_cli(SMALL + common + ["trainer.compile=true", f"hydra.run.dir={tmp_path / 'compiled'}"],
                      timeout=600))
    assert "torch.compile failed" not in proc.stdout + proc.stderr  # it really ran compiled
    assert "leaked semaphore" not in proc.stderr  # compiling uses tqdm, whose lock spawned workers had leaked
    compiled = checkpoint_weights(tmp_path / "compiled")
    assert not [key for key in compiled if "_orig_mod" in key or key.startswith("module.")]
    assert_same_weights(compiled, _train(tmp_path, "eager", common), atol=1e-5)


@pytest.mark.slow
def test_fsdp_bf16_mixed_trains_with_fsdps_own_mixed_precision(tmp_path):
    proc = ok(run_cli(SMALL + FSDP_2 + ["trainer.precision=bf16-mixed", "optimizer=adamw", "optimizer.lr=3e-3",
                                        "trainer.max_steps=60", f"hydra.run.dir={tmp_path}"]))
    weights = checkpoint_weights(tmp_path)
    assert all(w.dtype == torch.float32 for w in weights.values())  # the shards stay float32
    assert "val/loss" in proc.stdout + proc.stderr


@pytest.mark.parametrize("overrides,message", [
    (["strategy=fsdp"], "strategy=fsdp needs a process group"),
    (["strategy=fsdp", "strategy.nproc_per_node=2", "strategy.bucket_cap_mb=5"],
     "strategy.bucket_cap_mb is not a setting of this strategy; it belongs to strategy=ddp"),
    (["strategy=fsdp", "strategy.nproc_per_node=2", "strategy.shard_classes=[Blok]"],
     "strategy=fsdp: shard class 'Blok' matches no module of Transformer"),
    (["strategy=fsdp", "strategy.nproc_per_node=2", "strategy.state_dict_type=shards"],
     "strategy.state_dict_type='shards' is unknown; use full (one plain file) or sharded"),
    # The same refusal as bucket_cap_mb's above, the other way round: -m slow.
    pytest.param(["strategy=ddp", "strategy.nproc_per_node=2", "strategy.state_dict_type=sharded"],
                 "strategy.state_dict_type is not a setting of this strategy; it belongs to strategy=fsdp",
                 marks=pytest.mark.slow),
])
def test_fsdp_mistakes_are_one_line_and_exit_2(tmp_path, overrides, message):
    proc = run_cli(SMALL + overrides + ["trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and message in errors[0], proc.stderr[-2000:]
