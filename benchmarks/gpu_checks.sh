#!/usr/bin/env bash
# What no CPU can show, on one CUDA GPU, in one call that ends by a deadline (a lent GPU is
# short): each stage runs under the time left, its whole output goes to OUT/checks.log, its
# last lines and exit status to the console. Figures from it go to benchmarks/RESULTS.md.
#
#   benchmarks/gpu_checks.sh OUT TEXT [SECONDS]
#     OUT      a folder for the log, OUT/checks.log (every stage's whole output)
#     TEXT     Tiny Shakespeare (README "Tiny Shakespeare"), for the baby-GPT preset
#     SECONDS  the whole budget (default 520)
#   STAGES="baby_gpt cuda_tests" benchmarks/gpu_checks.sh ...   # only these stages
#
# Stages, most wanted first: bench_gpt.py's GPU table (MFU; ringtrain vs the raw loop,
# Lightning, Accelerate) with a profile of each row's step; bench_compile.py on the GPU; the baby-GPT preset to its end (nanoGPT reaches val loss ~1.47) and
# a sample from its checkpoint; 16-mixed (GradScaler) stopped and resumed against one run;
# NCCL ddp with torch.compile and NCCL fsdp with bf16 (one rank each: one GPU); the tests
# marked `cuda`.
#
# On this workplace's GPU machines (RESULTS.md, 2026-11-27) torch is /opt/torch/.venv's python,
# and ringtrain, hydra-core, omegaconf and antlr4 travel as one folder of pure-Python packages
# (`pip install --no-deps --target .gpu_site .`, the other three copied from a venv):
#   PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=$PWD/.gpu_site STAGES="env bench_gpt" benchmarks/gpu_checks.sh "$OUT" -
set -u
out=$1; text=$2; deadline=$((SECONDS + ${3:-520}))
mkdir -p "$out"; runs=$(mktemp -d)
export PYTHONUNBUFFERED=1

stage() {  # stage NAME MAX_SECONDS COMMAND...: under min(MAX, time left - 5)
    local name=$1 limit=$2; shift 2
    [[ -n ${STAGES:-} && " $STAGES " != *" $name "* ]] && return 0
    local left=$((deadline - SECONDS - 5))
    ((left < limit)) && limit=$left
    if ((limit < 15)); then echo "== $name: skipped, ${limit}s left"; return 1; fi
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" >"$runs/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-12}" "$runs/$name.log" | cut -c1-300
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    { echo "== $name: $*"; cat "$runs/$name.log"; echo "== $name: exit $rc after $((SECONDS - start)) s"; } >>"$out/checks.log"
    return $rc
}

quiet=(trainer.progress_bar=false)
stage env 30 bash -c 'nvidia-smi -L; python -c "import torch, sys, hydra, ringtrain; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(), hydra.__version__, ringtrain.__file__)"'

# The rows three times (forward, reversed, forward), each row's last 2 warm-up steps of the first
# round profiled: what ringtrain's step runs that the raw loop's does not (traces to OUT).
TAIL=70 stage bench_gpt 400 python benchmarks/bench_gpt.py --warmup 10 --steps 30 --windows 2 --rounds 3 --profile "$out"

# Regional against whole-model compile against a raw compiled loop: time to the third step from
# an empty compile cache, and the step time (each a fresh process).
stage bench_compile 110 python benchmarks/bench_compile.py --layers 12 --steps 20

stage baby_gpt 170 python train.py experiment=shakespeare_char_gpu "data.path=$text" "data.cache_dir=$runs/cache" \
    trainer.log_every_n_steps=250 "hydra.run.dir=$runs/baby" "${quiet[@]}" \
  && stage sample 40 python -m ringtrain sample "checkpoint=$runs/baby/checkpoints/last.pt" prompt=ROMEO: \
      max_new_tokens=200 temperature=0.8 top_k=200 seed=0

# 16-mixed: 40 steps in one run, against 20 steps, then the same command resumed to 40.
small=(model=transformer trainer.accelerator=cuda trainer.precision=16-mixed trainer.log_every_n_steps=10
       trainer.eval_every_n_steps=20 trainer.limit_val_batches=2 "${quiet[@]}")
stage fp16_straight 60 python train.py "${small[@]}" trainer.max_steps=40 "hydra.run.dir=$runs/fp16_one" \
  && stage fp16_first_half 60 python train.py "${small[@]}" trainer.max_steps=20 "hydra.run.dir=$runs/fp16_two" \
  && stage fp16_resumed 60 python train.py "${small[@]}" trainer.max_steps=40 "hydra.run.dir=$runs/fp16_two" \
  && stage fp16_compare 30 python - "$runs/fp16_one" "$runs/fp16_two" <<'EOF'
import sys, torch
one, two = (torch.load(f"{d}/checkpoints/last.pt", weights_only=True) for d in sys.argv[1:])
print("steps", one["progress"]["step"] if "progress" in one else "?", "keys", sorted(one)[:12])
diff = max((one["model"][k].double() - two["model"][k].double()).abs().max().item() for k in one["model"])
print("GradScaler states", one.get("scaler"), two.get("scaler"))
print(f"16-mixed, 40 steps in one run vs 20 + resumed 20: largest weight difference {diff:.3g}")
EOF

gpt=(experiment=gpt2_small trainer.max_steps=30 trainer.eval_every_n_steps=30 trainer.limit_val_batches=2
     trainer.log_every_n_steps=10 data.num_train_tokens=600000 data.num_val_tokens=40000 "${quiet[@]}")
stage ddp_nccl_compiled 120 python -m torch.distributed.run --standalone --nproc_per_node=1 train.py strategy=ddp trainer.compile=true \
    "${gpt[@]}" "hydra.run.dir=$runs/ddp"
stage fsdp_nccl_bf16 90 python -m torch.distributed.run --standalone --nproc_per_node=1 train.py strategy=fsdp "${gpt[@]}" "hydra.run.dir=$runs/fsdp"

# tests/conftest.py hides the GPU from the CPU-exact suite; these are the tests that need it.
TAIL=20 stage cuda_tests 120 env RINGTRAIN_TEST_CUDA=1 python -m pytest -v -rfs -p no:cacheprovider -m cuda
echo "== done after $SECONDS s"
