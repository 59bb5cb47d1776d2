"""ringtrain's step time for the small Transformer against a hand-written loop doing the same work.

Both sides train the same model (models/transformer.py, the `model=transformer` sizes) on the
same synthetic token data with fused AdamW (decay on 2-D weights only, ringtrain's default), batch 32, for the same
number of steps, read the train loss every 50 steps (a hand-written loop prints it, ringtrain
logs it to TensorBoard) and run one validation batch at the end. ringtrain runs its real
Trainer (no checkpoint, no progress bar); the hand-written loop is what one would write from
the seed tutorials, with batches gathered directly from the token tensor.

    python benchmarks/bench_transformer_overhead.py [--steps 90] [--repeats 5] [--threads 2]

Prints each side's seconds per step (best of N, interleaved) and ringtrain's overhead in %.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]

from ringtrain.data.tokens import MarkovTokens  # noqa: E402
from ringtrain.models.transformer import Transformer  # noqa: E402
from ringtrain.optim import parameter_groups  # noqa: E402

SIZES = dict(block_size=64, n_layers=2, n_heads=4, d_model=128, dropout=0.0)  # conf/model/transformer.yaml
BATCH, LR, BETAS, DECAY, LOG_EVERY = 32, 1e-3, (0.9, 0.95), 0.1, 50


def hand_written_loop(steps: int) -> float:
    """Seconds for `steps` optimizer steps plus one validation batch, written by hand."""
    data = MarkovTokens(seq_len=SIZES["block_size"])  # data=tokens's defaults, as ringtrain's run
    data.setup()
    train, val = data.train.windows, data.val.windows
    torch.manual_seed(0)
    model = Transformer(vocab_size=64, **SIZES)
    optimizer = torch.optim.AdamW(parameter_groups(model, DECAY), lr=LR, betas=BETAS, fused=True)  # as ringtrain's
    order = torch.randperm(len(train))
    start = time.perf_counter()
    for step in range(steps):
        window = train[order[step * BATCH : (step + 1) * BATCH]]
        x, y = window[:, :-1], window[:, 1:]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps:
            loss.item()  # what a hand-written loop prints
    model.eval()
    with torch.no_grad():
        window = val[:BATCH]
        F.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten()).item()
    return time.perf_counter() - start


def ringtrain_loop(steps: int) -> float:
    from hydra import compose, initialize_config_dir

    from ringtrain.config.schema import validate
    from ringtrain.run import train_rank

    overrides = [
        "model=transformer", "optimizer=adamw", f"optimizer.lr={LR}", f"trainer.max_steps={steps}",
        "trainer.checkpoint=false", "trainer.progress_bar=false", "trainer.limit_val_batches=1",
        f"trainer.log_every_n_steps={LOG_EVERY}",
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        run = validate(compose(config_name="train", overrides=overrides))
    with tempfile.TemporaryDirectory() as run_dir:
        return train_rank(run, run_dir).train_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=90, help="< 98, one epoch: no epoch-end eval")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.disable(logging.INFO)

    times = {"hand-written": [], "ringtrain": []}
    hand_written_loop(10), ringtrain_loop(10)  # warm up allocator and kernels alike
    for _ in range(args.repeats):  # interleaved, so drifting machine load hits both alike
        times["hand-written"].append(hand_written_loop(args.steps))
        times["ringtrain"].append(ringtrain_loop(args.steps))
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.steps} steps, best of {args.repeats}")
    for name, runs in times.items():
        per_step = [t / args.steps * 1e3 for t in runs]
        print(f"{name:13s} {min(per_step):7.2f} ms/step (median {statistics.median(per_step):7.2f})")
    overhead = min(times["ringtrain"]) / min(times["hand-written"]) - 1
    print(f"ringtrain overhead vs hand-written: {overhead * 100:+.1f} %")


if __name__ == "__main__":
    main()
