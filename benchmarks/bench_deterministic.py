"""What trainer.deterministic=true costs on a CPU: training steps of the default model=transformer
(2 layers, d_model 128, block 64, data=tokens' 64 ids, batch 32, AdamW, no dropout), with
ringtrain's setting off and on alternately (10 rounds of 10 steps each), timed by this process's
CPU time, which other processes on a shared machine disturb less than the wall clock. One
thread (OMP_NUM_THREADS=1): with two, the threads' spin-waiting under load dominated the figures.

    OMP_NUM_THREADS=1 python benchmarks/bench_deterministic.py

On a GPU the cost is elsewhere (deterministic cuBLAS workspaces, no cuDNN autotuning, the
deterministic variants of scatter/index kernels) and is not measured here.
"""
import statistics
import time

import torch

from ringtrain.models.transformer import Transformer
from ringtrain.strategies import use_deterministic_algorithms


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(vocab_size=64, block_size=64, n_layers=2, n_heads=4, d_model=128, dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = torch.randint(0, 64, (32, 64)), torch.randint(0, 64, (32, 64))

    def ms_per_step(steps: int) -> float:
        start = time.process_time()
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(model(inputs).reshape(-1, 64), targets.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return (time.process_time() - start) / steps * 1000

    ms_per_step(5)  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(10):
        for on in (False, True):
            torch.use_deterministic_algorithms(False)
            use_deterministic_algorithms(on)
            times[on].append(ms_per_step(10))
    for on, values in times.items():
        print(f"deterministic={str(on).lower()}: median {statistics.median(values):.1f} ms/step "
              f"(CPU time; rounds {min(values):.1f}-{max(values):.1f})")


if __name__ == "__main__":
    main()
