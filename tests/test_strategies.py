"""Strategies are components: a user's own strategy class, from a --config-dir of theirs,
trains 2 ranks like the shipped ones; and no code outside ringtrain/strategies asks which
strategy it has."""
from __future__ import annotations

import ast

import torch

from conftest import REPO, run_cli

# A user's strategy: ddp whose gradients are all-reduced in float16
# (torch.distributed.algorithms.ddp_comm_hooks), counting each hook call in a file per rank.
COMPRESSED_DDP = '''
"""ddp with float16 gradient compression: the user's own strategy class."""
import os

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

from ringtrain.strategies.ddp import DDP


def counted_fp16_hook(log_prefix, bucket):
    with open(f"{log_prefix}.rank{os.environ['RANK']}", "a") as log:
        log.write(f"bucket {bucket.index()}\\n")
    return fp16_compress_hook(None, bucket)


class CompressedDDP(DDP):
    def __init__(self, *, hook_log: str, **ddp_options):
        super().__init__(**ddp_options)
        self.hook_log = hook_log

    def wrap(self, module, dist):
        wrapped = super().wrap(module, dist)
        wrapped.register_comm_hook(self.hook_log, counted_fp16_hook)
        return wrapped
'''

# The user's option extends the shipped ddp one: every ddp setting, plus its own.
COMPRESSED_DDP_YAML = """
defaults:
  - ddp
  - _self_
_target_: my_strategies.compressed.CompressedDDP
hook_log: hook-calls
"""

MLP = ["model=mlp", "data.num_samples=256", "data.num_val_samples=64", "trainer.batch_size=16",
       "trainer.max_steps=6", "trainer.log_every_n_steps=2"]


def test_a_users_strategy_from_their_config_dir_trains_two_ranks_and_its_hook_runs(tmp_path):
    (tmp_path / "my_strategies").mkdir()
    (tmp_path / "my_strategies" / "__init__.py").write_text("")
    (tmp_path / "my_strategies" / "compressed.py").write_text(COMPRESSED_DDP)
    (tmp_path / "my_conf" / "strategy").mkdir(parents=True)
    (tmp_path / "my_conf" / "strategy" / "compressed_ddp.yaml").write_text(COMPRESSED_DDP_YAML)
    run_dir = tmp_path / "run"
    proc = run_cli(["--config-dir", "my_conf", "strategy=compressed_ddp", "strategy.nproc_per_node=2",
                    f"strategy.hook_log={tmp_path / 'hook'}", *MLP, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        calls = (tmp_path / f"hook.rank{rank}").read_text().splitlines()
        assert len(calls) >= 6 and set(calls) == {"bucket 0"}  # one bucket, at least once a step
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert state["config"]["strategy"]["_target_"] == "my_strategies.compressed.CompressedDDP"
    assert state["config"]["strategy"]["bucket_cap_mb"] == 25.0  # inherited from conf/strategy/ddp.yaml
    assert state["progress"]["step"] == 6


def test_no_code_outside_the_strategies_compares_a_strategy_name():
    """The loop, the job, the config and the tools call the strategy's methods; only the
    strategy classes know what they are (a name in a string or an isinstance of a strategy
    class elsewhere would bring the comparisons back)."""
    names = {"single", "dp", "ddp", "fsdp"}
    offenders = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        if "strategies" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                constants = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
                if names & {c for c in constants if isinstance(c, str)}:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr == "name" and "strategy" in ast.unparse(node.value):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}")
    assert offenders == []


def test_ddp_without_a_launcher_or_nproc_per_node_trains_in_one_process_and_says_how_to_start_ranks(tmp_path):
    """One rank of ddp is legitimate, so it trains (as Lightning warns and goes on), but the log says so."""
    proc = run_cli(["strategy=ddp", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [warning] = [line for line in proc.stdout.splitlines() if "trains in this one process" in line]
    assert "torchrun --nproc_per_node=N" in warning and "strategy.nproc_per_node=N" in warning, warning
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()
