"""A tiny Hugging Face GPT-2 trained through ringtrain, a raw torch loop and Lightning, in one run.

All three train `transformers.GPT2LMHeadModel` (2 layers, 4 heads, d=128, 64 positions, no
dropout) from the same seed on data=tokens's Markov chain (vocabulary 64, windows of 64), batch
32, AdamW lr 1e-3 with weight decay 0.1 on 2-D weights only, for the same number of steps, read
the train loss every 50 steps and validate one batch at the end.

- ringtrain: the model is a YAML-style `_target_` node (`transformers.GPT2LMHeadModel` with a
  nested `GPT2Config` node) on `data=tokens`, run by the real config path (validate, then the
  Trainer's loop; no checkpoint, no progress bar). Its time is the loop's (`train_seconds`).
- raw: what one writes with torch alone: batches gathered straight from the window tensor,
  `model(input_ids).logits`, cross-entropy, backward, step.
- lightning (when installed): a LightningModule with the same `training_step` and optimizer,
  the same batches through a DataLoader of whole batches, `Trainer(max_steps=...)` with logger,
  checkpointing, progress bar and model summary off; timed from `on_train_start` to
  `on_train_end`, the validation batch included (its set-up is not in it, as ringtrain's is not).

    python benchmarks/bench_hf_gpt2.py [--steps 90] [--repeats 5] [--threads 2]

Prints each contestant's ms per step (best of N, interleaved, and the median), its validation
loss on the same batch (raw and Lightning see the same batches in the same order, ringtrain its
own sampler's order), and the ratios to the raw loop. Issue 19's target: ringtrain at most 5 % slower than raw.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]

from ringtrain.optim import parameter_groups  # noqa: E402
from ringtrain.data.tokens import MarkovTokens  # noqa: E402

VOCAB, POSITIONS = 64, 64
GPT2 = dict(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=128, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
BATCH, LR, BETAS, DECAY, LOG_EVERY = 32, 1e-3, (0.9, 0.95), 0.1, 50


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # ringtrain seeds with trainer.seed=0 before it builds the model
    return GPT2LMHeadModel(GPT2Config(**GPT2))


def windows():
    data = MarkovTokens(vocab_size=VOCAB, seq_len=POSITIONS)  # data=tokens's defaults otherwise
    data.setup()
    return data.train.windows, data.val.windows


def val_loss(model, val) -> float:
    """The loss on the first validation batch: the batch ringtrain's limit_val_batches=1 reads."""
    model.eval()
    with torch.no_grad():
        window = val[:BATCH]
        return F.cross_entropy(model(window[:, :-1]).logits.flatten(0, 1), window[:, 1:].flatten()).item()


def raw_loop(steps: int) -> tuple[float, float]:
    """Seconds for `steps` steps plus one validation batch, and the validation loss."""
    train, val = windows()
    model = gpt2()
    optimizer = torch.optim.AdamW(parameter_groups(model, DECAY), lr=LR, betas=BETAS)
    order = torch.randperm(len(train))
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        window = train[order[step * BATCH : (step + 1) * BATCH]]
        x, y = window[:, :-1], window[:, 1:]
        loss = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps:
            loss.item()  # what a hand-written loop prints
    validated = val_loss(model, val)
    return time.perf_counter() - start, validated


def ringtrain_loop(steps: int) -> tuple[float, float]:
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from ringtrain.config.schema import validate
    from ringtrain.run import train_rank

    overrides = [
        "data=tokens", "task=language_model", "optimizer=adamw", f"optimizer.lr={LR}", f"trainer.max_steps={steps}",
        "trainer.checkpoint=false", "trainer.progress_bar=false", "trainer.limit_val_batches=1",
        f"trainer.log_every_n_steps={LOG_EVERY}", f"data.seq_len={POSITIONS}",
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    with open_dict(cfg):  # what my_conf/model/gpt2.yaml would hold
        cfg.model = {"_target_": "transformers.GPT2LMHeadModel",
                     "config": {"_target_": "transformers.GPT2Config", **GPT2}}
    run = validate(cfg)
    with tempfile.TemporaryDirectory() as run_dir:
        result = train_rank(run, run_dir)
    return result.train_seconds, result.metrics["val/loss"]


def lightning_loop(steps: int) -> tuple[float, float] | None:
    try:
        import lightning as L
    except ImportError:
        return None
    from torch.utils.data import DataLoader, Dataset

    train, val = windows()
    model = gpt2()
    order = torch.randperm(len(train))

    class Batches(Dataset):  # whole batches, gathered as the raw loop gathers them
        def __len__(self):
            return len(train) // BATCH

        def __getitem__(self, i):
            window = train[order[i * BATCH : (i + 1) * BATCH]]
            return window[:, :-1], window[:, 1:]

    class GPT2Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.seconds = model, 0.0

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.model(x).logits.flatten(0, 1), y.flatten())
            if (self.global_step + 1) % LOG_EVERY == 0 or self.global_step + 1 == steps:
                loss.item()
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(parameter_groups(self.model, DECAY), lr=LR, betas=BETAS)

        def on_train_start(self):
            self.started = time.perf_counter()

        def on_train_end(self):
            self.validated = val_loss(self.model, val)  # the one validation batch the others run
            self.seconds = time.perf_counter() - self.started

    module = GPT2Module()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(Batches(), batch_size=None, shuffle=False))
    return module.seconds, module.validated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=90, help="< 97, one epoch: no epoch-end eval")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.disable(logging.INFO)
    warnings.filterwarnings("ignore")  # Lightning's advice on DataLoader workers, and the like

    contestants = {"raw": raw_loop, "ringtrain": ringtrain_loop, "lightning": lightning_loop}
    if lightning_loop(2) is None:
        del contestants["lightning"]
        print("lightning: not installed, skipped (pip install lightning)")
    for run in contestants.values():
        run(10)  # warm up allocator and kernels alike
    times: dict[str, list[float]] = {name: [] for name in contestants}
    losses: dict[str, float] = {}
    names = list(contestants)
    for repeat in range(args.repeats):  # interleaved, so drifting machine load hits all alike,
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:  # each first in turn
            seconds, losses[name] = contestants[name](args.steps)
            times[name].append(seconds)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.steps} steps, best of {args.repeats}")
    for name, runs in times.items():
        per_step = [t / args.steps * 1e3 for t in runs]
        ratio = min(runs) / min(times["raw"])
        median_ratio = statistics.median(runs) / statistics.median(times["raw"])
        print(f"{name:10s} {min(per_step):7.2f} ms/step (median {statistics.median(per_step):7.2f})  "
              f"x{ratio:.3f} raw's (median x{median_ratio:.3f})  val loss {losses[name]:.4f}")


if __name__ == "__main__":
    main()
