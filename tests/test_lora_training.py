"""LoRA fine-tuning of a Hugging Face causal LM with nothing but YAML: a user's config dir (a
`model/` option whose `_target_` is AutoModelForCausalLM.from_pretrained of a local directory)
and `adapter=lora adapter.target_modules=[...] adapter.r=4` on the command line.

What the run must do (trainer/run.py applies the adapter, trainer/loop/setup.py trains only
requires_grad parameters and keeps, in its checkpoints, only those plus `base`, a CRC-32 of the
frozen base, trainer/checkpoints/frozen_base.py):

1. change only the adapters: the frozen base at the end of training (the model in the trainer's
   process, dumped by a test wrapper around train.py) is bit-identical to the pretrained one;
   the checkpoint and its optimizer state hold only adapter tensors, a small fraction of a full
   fine-tune's (sizes measured and printed);
2. stopped by SIGTERM at an observed step, the same command again resumes and ends bit-identical
   to an uninterrupted run;
3. `ringtrain export format=peft` loads with peft.PeftModel.from_pretrained over the pretrained
   directory and `format=hf` (merged) with AutoModelForCausalLM.from_pretrained, both giving the
   checkpoint's logits (rebuild_model) to 1e-5;
4. train as 2-rank ddp (global batch 2x8 matches one process's 16 to 1e-5, with SGD) and 2-rank
   fsdp (slow, also resumed), and `ringtrain evaluate` reads their checkpoints;
5. refuse in one line, exit 2, writing nothing: targets that match nothing, a target that is no
   Linear/Conv1D, and a checkpoint whose base directory's weights have changed since.

The pretrained model is made here with save_pretrained from a tiny GPT2Config without dropout
(so that ddp and single match); there is no hub (HF_HUB_OFFLINE=1).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import QUIET, REPO, run_cli, run_module
from helpers import Job, assert_same_state, job_ok, ok, refused
from test_hf_pretrained import pretrained_user_folder

transformers = pytest.importorskip("transformers")

STEPS = 30
COMMON = ["model=pretrained_gpt2", "optimizer=adamw", "optimizer.lr=1e-2", "trainer.eval_every_n_steps=10",
          "trainer.log_every_n_steps=5"]
LORA = ["adapter=lora", "adapter.target_modules=[c_attn,c_fc]", "adapter.r=4"]
SINGLE = COMMON + LORA + [f"trainer.max_steps={STEPS}", "trainer.batch_size=16"]
# ddp and fsdp against one process with SGD (see the ddp test): a shorter run.
SGD = [*COMMON, *LORA, "optimizer=sgd", "optimizer.lr=0.5", "trainer.max_steps=20"]

# train.py, and at the end of training the model as the trainer's process holds it (frozen base
# included) saved to <run dir>/final_weights.pt: what the checkpoints leave out. Test tooling,
# like tests/interruptible_train.py; it changes no number.
DUMPING_WRAPPER = textwrap.dedent("""\
    import os, sys
    import torch
    import ringtrain.run as run

    TRAIN = sys.argv.pop(1)
    report = run._report

    def report_and_dump(result, model, run_dir):
        weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        torch.save(weights, os.path.join(str(run_dir), "final_weights.pt"))
        report(result, model, run_dir)

    run._report = report_and_dump
    sys.argv[0] = TRAIN
    with open(TRAIN) as file:
        code = compile(file.read(), TRAIN, "exec")
    exec(code, {"__name__": "__main__", "__file__": TRAIN})
""")
INTERRUPTIBLE = REPO / "tests" / "interruptible_train.py"


@pytest.fixture(scope="module", autouse=True)
def offline(hf_offline):  # conftest.py: no hub, in this process and its subprocesses
    yield


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> Path:
    return pretrained_user_folder(tmp_path_factory.mktemp("lora_user"), n_embd=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)


@pytest.fixture(scope="module")
def dumping_wrapper(tmp_path_factory) -> Path:
    """The test's wrapper around train.py (not the user's: their folder holds no Python)."""
    path = tmp_path_factory.mktemp("test_tools") / "dump_final_weights.py"
    path.write_text(DUMPING_WRAPPER)
    return path


def _args(user: Path, run: Path, overrides: list[str]) -> list[str]:
    return ["--config-dir", str(user / "conf"), *overrides, f"hydra.run.dir={run}"]


def _train(user: Path, name: str, overrides: list[str], wrapper: Path | None = None) -> Path:
    run = user / name
    launcher = [sys.executable, str(wrapper)] if wrapper else None
    ok(run_cli(_args(user, run, overrides), cwd=user, launcher=launcher))
    return run


@pytest.fixture(scope="module")
def lora_run(user, dumping_wrapper) -> Path:
    """The uninterrupted single-process LoRA run (AdamW, 30 steps, batch 16) tests 1-3 use,
    with the trainer's model at its end in final_weights.pt."""
    return _train(user, "lora", SINGLE, dumping_wrapper)


def _checkpoint(run: Path, name: str = "last.pt") -> dict:
    return torch.load(run / "checkpoints" / name, weights_only=True)


def _train_losses(run: Path) -> list[float]:
    return [float(v) for v in re.findall(r"step \d+: loss=([\d.]+)", (run / "train.log").read_text())]


def _assert_loss_fell(run: Path) -> None:
    losses = _train_losses(run)
    assert len(losses) >= 4 and losses[-1] < 0.95 * losses[0], losses


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _pretrained(user: Path, directory: str = "tiny-gpt2"):
    return transformers.AutoModelForCausalLM.from_pretrained(user / directory).eval()


def _base_name(name: str) -> str:
    """The pretrained model's name of a LoRA-wrapped model's frozen tensor."""
    return name.replace(".base_layer.", ".")


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _step_file(run: Path) -> Path:
    return max((run / "checkpoints").glob("step-*.pt"))


def _job(user: Path, state: dict, path: str) -> dict:
    """The job a tool composes from the checkpoint, with the user's own options (--config-dir)."""
    from ringtrain.tools import composed_job

    return composed_job(state, path, config_dir=user / "conf")


def _refused(proc, *phrases: str) -> str:
    """Exit 2 and exactly one `error:` line on stderr holding every phrase (no progress bar either)."""
    return refused(proc, *phrases)


def _snapshot(directory: Path) -> dict[str, str]:
    """Every file under `directory` and a hash of its bytes."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


# --- 1. only the adapters train; the checkpoint keeps only them ---------------------------------


def test_lora_trains_only_the_adapters_and_its_checkpoint_is_a_small_fraction_of_a_full_fine_tunes(user, lora_run):
    from ringtrain.checkpoints.frozen_base import base_identity
    from ringtrain.tools.checkpoint_model import build_checked_model, read_checkpoint, rebuild_model

    _assert_loss_fell(lora_run)
    pretrained = _pretrained(user).state_dict()
    final = torch.load(lora_run / "final_weights.pt", weights_only=True)  # the trainer's model at the end
    adapters = sorted(name for name in final if _is_adapter(name))
    assert len(adapters) == 2 * 2 * 2  # lora_A and lora_B of c_attn and c_fc in each of 2 layers
    # Every frozen tensor is, bit for bit, the pretrained one; nothing else was added or lost.
    frozen = {_base_name(name): tensor for name, tensor in final.items() if not _is_adapter(name)}
    assert frozen.keys() == pretrained.keys()
    for name, tensor in frozen.items():
        assert torch.equal(tensor, pretrained[name]), f"frozen {name} changed in training"

    path = str(lora_run / "checkpoints" / "last.pt")
    state = read_checkpoint(path)
    job = _job(user, state, path)
    # The checkpoint keeps the adapters (the trained ones) and the base's identity, not the base.
    assert sorted(state["model"]) == adapters
    for name in adapters:
        assert torch.equal(state["model"][name], final[name]), name
    initial = build_checked_model(state, path, job).state_dict()  # seeded as the run was: its starting adapters
    for name in adapters:
        assert not torch.equal(initial[name], final[name]), f"{name} did not train"
    assert state["base"] == base_identity(build_checked_model(state, path, job))
    # Its optimizer state holds only the adapters.
    optimizer = state["optimizer"]
    assert sorted(optimizer["state"]) == adapters
    assert sorted(p for group in optimizer["param_groups"] for p in group["params"]) == adapters
    # The rebuilt model (the tools' and resume's): the pretrained base with the trained adapters.
    rebuilt = rebuild_model(state, path, job).state_dict()
    assert rebuilt.keys() == final.keys()
    for name, tensor in rebuilt.items():
        assert torch.equal(tensor, final[name] if _is_adapter(name) else pretrained[_base_name(name)]), name

    # A full fine-tune of the same model, same command without the adapter.
    full = _train(user, "full", COMMON + ["trainer.max_steps=10", "trainer.batch_size=16"])
    full_state = _checkpoint(full)
    assert len(full_state["model"]) == len(pretrained) and "base" not in full_state
    lora_file, full_file = _step_file(lora_run).stat().st_size, _step_file(full).stat().st_size
    lora_optim, full_optim = _tensor_bytes(optimizer["state"]), _tensor_bytes(full_state["optimizer"]["state"])
    print(f"\nLoRA vs full fine-tune of a {sum(t.numel() for t in pretrained.values())}-element GPT-2: step file "
          f"{lora_file} vs {full_file} bytes ({lora_file / full_file:.1%}), optimizer state {lora_optim} vs "
          f"{full_optim} bytes ({lora_optim / full_optim:.1%})")
    assert lora_file < 0.1 * full_file
    assert lora_optim < 0.06 * full_optim


# --- 2. SIGTERM, then the same command ---------------------------------------------------------


@pytest.mark.slow
def test_sigterm_at_an_observed_step_then_the_same_command_resumes_bit_identical(user, lora_run, tmp_path):
    run = tmp_path / "interrupted"
    args = _args(user, run, SINGLE)
    stop_at = 13  # after the validation (and save) at step 10, well before the next at 20

    release = tmp_path / "release"  # the job holds after step 13 until the signal was sent

    def job(hold_at_step: int = 0) -> Job:
        """tests/interruptible_train.py (train.py, each step announced), as test_resilience.py runs it."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "RINGTRAIN_TEST_STEP_SECONDS": "0",
               "RINGTRAIN_TEST_HOLD_AT_STEP": str(hold_at_step), "RINGTRAIN_TEST_HOLD_UNTIL_FILE": str(release)}
        env.pop("PYTHONPATH", None)  # the worktree comes first through the wrapper itself
        return Job([sys.executable, str(INTERRUPTIBLE), *args, *QUIET], cwd=user, env=env)

    with job(hold_at_step=stop_at) as interrupted:
        interrupted.wait_for_step(stop_at)
        interrupted.send_signal(signal.SIGTERM)
        release.touch()
        status, output = interrupted.finish()
    assert status == 143, output[-4000:]
    stopped = re.search(r"stopped by SIGTERM after step (\d+); last.pt saved", output)
    assert stopped, output[-4000:]
    saved = _checkpoint(run)
    assert saved["progress"]["step"] == int(stopped.group(1))
    assert saved["progress"]["step"] == stop_at  # held there until signalled: the stop saved it, not a validation
    assert sorted(saved["model"]) == sorted(_checkpoint(lora_run)["model"])  # adapters only here too

    with job() as again:  # the same command: trainer.resume=auto
        output = job_ok(again.finish())
    resumed = re.search(r"resuming from \S+ \(step (\d+)\)", output)
    assert resumed and int(resumed.group(1)) == saved["progress"]["step"], output[-4000:]
    ended, reference = _checkpoint(run), _checkpoint(lora_run)
    assert ended["progress"] == reference["progress"] and ended["progress"]["step"] == STEPS
    for part in ("model", "optimizer", "scheduler", "base"):
        assert_same_state(ended[part], reference[part], part)


# --- 3. exports, loaded by peft and transformers -----------------------------------------------


def test_peft_and_merged_exports_load_with_their_libraries_and_give_the_checkpoints_logits(user, lora_run):
    from peft import PeftModel

    from ringtrain.tools.checkpoint_model import read_checkpoint, rebuild_model
    from ringtrain.tools.export import export

    checkpoint = lora_run / "checkpoints" / "last.pt"
    adapter_dir, merged_dir = user / "exported-adapter", user / "exported-merged"
    ok(run_module("ringtrain", ["export", "--config-dir", str(user / "conf"), f"checkpoint={checkpoint}", "format=peft",
                                f"output={adapter_dir}"], cwd=user))
    state = read_checkpoint(str(checkpoint))
    job = _job(user, state, str(checkpoint))
    export(str(checkpoint), "hf", str(merged_dir), job=job)  # `ringtrain export format=hf` in this process (faster)
    assert sorted(p.name for p in adapter_dir.iterdir()) == [".ringtrain-export", "adapter_config.json",
                                                             "adapter_model.safetensors"]
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(user / "tiny-gpt2")

    ours = rebuild_model(state, str(checkpoint), job).eval()
    with_adapter = PeftModel.from_pretrained(_pretrained(user), adapter_dir).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert type(merged) is transformers.GPT2LMHeadModel
    assert merged.state_dict().keys() == _pretrained(user).state_dict().keys()  # its own names, no adapter
    batch = torch.randint(ours.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(batch).logits
        base = _pretrained(user)(batch).logits
        assert (expected - base).abs().max() > 1e-2  # the adapters matter: a lost one would show
        for name, model in (("peft", with_adapter), ("merged", merged)):
            diff = (model(batch).logits - expected).abs().max().item()
            assert diff <= 1e-5, f"{name} export's logits differ by {diff}"


# --- 4. ddp and fsdp ---------------------------------------------------------------------------


def _evaluates(user: Path, run: Path) -> None:
    """`ringtrain evaluate` of the run's last.pt gives the run's last validation loss."""
    proc = ok(run_module("ringtrain", ["evaluate", "--config-dir", str(user / "conf"),
                                       f"checkpoint={run / 'checkpoints' / 'last.pt'}"], cwd=user))
    final = json.loads((run / "metrics.json").read_text())["final"]["val/loss"]
    assert proc.stdout.splitlines()[0] == f"val/loss={final:.6g}"


def _matches_single(run: Path, single: Path, steps: int, atol: float) -> None:
    state, reference = _checkpoint(run), _checkpoint(single)
    assert state["progress"]["step"] == steps and state["base"] == reference["base"]
    assert state["model"].keys() == reference["model"].keys()  # adapters only
    assert sorted(state["optimizer"]["state"]) == sorted(reference["optimizer"]["state"])
    for name, tensor in state["model"].items():
        diff = (tensor.double() - reference["model"][name].double()).abs().max().item()
        assert diff <= atol, f"{name} differs by {diff} from the single-process run"


@pytest.fixture(scope="module")
def sgd_run(user) -> Path:
    """One process, batch 16, SGD: what 2 ranks of 8 must match. SGD, as Adam's first steps take
    each element's gradient sign at full lr, so the rounding differences of a 2-rank all-reduce
    (1e-9 here) grow to 1e-3 in 30 steps: no 1e-5 match with Adam."""
    return _train(user, "sgd-single", [*SGD, "trainer.batch_size=16"])


@pytest.mark.slow
def test_lora_as_two_rank_ddp_matches_one_process_on_the_same_global_batch_and_evaluates(user, sgd_run):
    run = _train(user, "ddp", [*SGD, "trainer.batch_size=8", "strategy=ddp", "strategy.nproc_per_node=2"])
    _assert_loss_fell(run)
    _matches_single(run, sgd_run, 20, atol=1e-5)  # 2 ranks x 8 = 16: the same steps, to float rounding
    _evaluates(user, run)


@pytest.mark.slow
def test_lora_under_two_rank_fsdp_trains_matches_evaluates_and_resumes(user, sgd_run):
    overrides = [*SGD, "trainer.batch_size=8", "strategy=fsdp", "strategy.nproc_per_node=2"]
    run = _train(user, "fsdp", overrides)
    _assert_loss_fell(run)
    _matches_single(run, sgd_run, 20, atol=1e-5)
    _evaluates(user, run)
    proc = ok(run_cli(_args(user, run, [*overrides, "trainer.max_steps=30"]), cwd=user))
    assert re.search(r"resuming from \S+ \(step 20\)", proc.stdout), proc.stdout[-3000:]
    assert _checkpoint(run)["progress"]["step"] == 30


# --- 5. refusals: one line, exit 2, nothing written ---------------------------------------------


@pytest.fixture(scope="module")
def nothing_matched(user, tmp_path_factory):
    """(the finished command, its folder) of a LoRA run whose targets match no module."""
    folder = tmp_path_factory.mktemp("nothing-matched")
    proc = run_cli(_args(user, folder / "run", [*COMMON, *LORA, "adapter.target_modules=[nope]"]), cwd=folder)
    return proc, folder


def test_lora_targets_that_match_nothing_are_refused_in_one_line_writing_nothing(nothing_matched):
    proc, folder = nothing_matched
    _refused(proc, "target_modules=['nope'] matches no module of GPT2LMHeadModel",
             "its Linear/Conv1D layers are named c_attn, c_proj, c_fc, lm_head")
    assert list(folder.iterdir()) == []  # no run directory, no outputs/


def test_a_lora_target_that_is_an_embedding_is_refused_in_one_line_writing_nothing(user, tmp_path):
    proc = run_cli(_args(user, tmp_path / "run", [*COMMON, *LORA, "adapter.target_modules=[wte]"]), cwd=tmp_path)
    _refused(proc, "matches transformer.wte, a Embedding", "LoRA wraps only Linear and Conv1D layers")
    assert list(tmp_path.iterdir()) == []


def test_a_refusal_is_the_only_line_on_stderr_with_a_from_pretrained_model(nothing_matched):
    refused(nothing_matched[0], "matches no module")


@pytest.fixture(scope="module")
def changed_base(user, tmp_path_factory) -> dict:
    """A short LoRA run on a copy of the pretrained directory, one element of one frozen tensor
    of that directory changed afterwards, and the same command run again (to resume): its
    process and the files of the folder before and after."""
    folder = tmp_path_factory.mktemp("changed-base")
    base, run = folder / "base", folder / "run"
    shutil.copytree(user / "tiny-gpt2", base)
    overrides = [*COMMON, *LORA, f"model.pretrained_model_name_or_path={base}", "trainer.max_steps=4"]
    ok(run_cli(_args(user, run, overrides), cwd=user))
    from safetensors.torch import load_file, save_file

    weights = load_file(base / "model.safetensors")
    name = "transformer.h.1.attn.c_proj.weight"  # frozen, and not a LoRA target
    weights[name] = weights[name].clone()
    weights[name][0, 0] += 1e-3
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    before = _snapshot(folder)
    resumed = run_cli(_args(user, run, overrides), cwd=user)  # the same command again: resume=auto
    return {"folder": folder, "checkpoint": run / "checkpoints" / "last.pt", "before": before,
            "resumed": resumed, "after": _snapshot(folder), "conf": user / "conf"}


BASE_CHANGED = "holds adapters trained on other base weights than this model's"


def test_resuming_over_a_changed_base_directory_is_refused_in_one_line(changed_base):
    _refused(changed_base["resumed"], BASE_CHANGED, str(changed_base["checkpoint"]))
    before, after = changed_base["before"], changed_base["after"]
    assert before.keys() == after.keys()  # no file added or removed
    changed = sorted(name for name in before if before[name] != after[name])
    assert changed == []  # the checkpoints, the base and the run's train.log as they were


def test_resuming_over_a_changed_base_directory_writes_nothing(changed_base):
    assert changed_base["after"] == changed_base["before"]


def test_evaluating_or_exporting_over_a_changed_base_directory_is_refused_in_one_line_writing_nothing(changed_base):
    from ringtrain.checkpoints.files import CheckpointError
    from ringtrain.tools.export import export

    folder, checkpoint = changed_base["folder"], changed_base["checkpoint"]
    before = _snapshot(folder)
    _refused(run_module("ringtrain", ["evaluate", "--config-dir", str(changed_base["conf"]), f"checkpoint={checkpoint}"],
                        cwd=folder), BASE_CHANGED)
    assert _snapshot(folder) == before  # no eval/ file
    from ringtrain.tools import composed_job
    from ringtrain.tools.checkpoint_model import read_checkpoint

    job = composed_job(read_checkpoint(str(checkpoint)), str(checkpoint), config_dir=changed_base["conf"])
    for format in ("peft", "hf"):  # `ringtrain export`, in this process
        with pytest.raises(CheckpointError, match=BASE_CHANGED):
            export(str(checkpoint), format, job=job)
    assert _snapshot(folder) == before  # no export/
