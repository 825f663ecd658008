#!/usr/bin/env bash
# nanochat's base-model speedrun on one GPU host (8 x H100 is the reference): install, download
# FineWeb-Edu, train the 65,536-token tokenizer, pretrain d20 on every GPU of the host, then bits per
# byte, CORE, samples and the report. One JAX process drives all local GPUs (no torchrun).
#
#   bash runs/speedrun.sh
#   screen -L -Logfile speedrun.log -S speedrun bash runs/speedrun.sh      # it runs for hours
#   WANDB_RUN=d20 bash runs/speedrun.sh                                      # log to wandb (after `wandb login`)
#
# Everything goes to $JAXCHAT_BASE_DIR (default ~/.cache/jaxchat): about 16 GB of shards, the tokenizer,
# checkpoints (5.2 GB each: float32 parameters and optimizer state), the report. Several hosts: runs/multihost_slurm.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

export JAXCHAT_BASE_DIR="${JAXCHAT_BASE_DIR:-$HOME/.cache/jaxchat}"
export PYTHONUNBUFFERED=1
WANDB_RUN="${WANDB_RUN:-dummy}"  # 'dummy' logs nothing to wandb
mkdir -p "$JAXCHAT_BASE_DIR"

# -----------------------------------------------------------------------------
# Python environment with the CUDA 12 build of JAX
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e '.[cuda12]'
python -c "import jax; print(f'JAX {jax.__version__}: {jax.device_count()} x {jax.devices()[0].device_kind}')"

# The report: system section now (JAX, devices, host, commit), one section per stage below
python -m jaxchat.report reset

# -----------------------------------------------------------------------------
# Data. The tokenizer trains on the first 2B characters: 2e9 / 250M characters per shard = 8 shards,
# plus one more because the last shard present is always the validation split.
python -m jaxchat.dataset -n 9
# The shards pretraining needs (nanochat's arithmetic in its speedrun.sh, for d20):
#   d20 has 560,988,200 parameters; the default --target-param-data-ratio=8 gives
#   8 x 560,988,200 // 524,288 = 8,559 steps of 524,288 tokens = 4.49B tokens.
#   At ~4.8 characters per token (the 65,536-token tokenizer on FineWeb-Edu) that is 21.5B characters.
#   Best-fit packing crops ~35% of the tokens it reads at T=2048 (nanochat's figure), so the loader reads
#   21.5B / 0.65 = 33.1B characters = 133 shards of 250M characters; + 1 validation shard = 134.
#   Rounded up to 150 for margin (~100 MB each, ~15 GB). (An epoch counter above 1 in the step
#   lines means the loader wrapped around: download more with a larger -n and resume.)
NUM_SHARDS=150
python -m jaxchat.dataset -n "$NUM_SHARDS" &
DATASET_DOWNLOAD_PID=$!
# The CORE eval bundle (~162 MB) meanwhile; on the CPU backend, so that it holds no GPU memory
JAX_PLATFORMS=cpu python -c "from jaxchat.core_eval import download_eval_bundle; download_eval_bundle()" &
BUNDLE_DOWNLOAD_PID=$!

# Tokenizer: vocabulary 2^16 = 65,536 on ~2B characters
python -m scripts.tok_train --max-chars=2000000000 --vocab-size=65536

echo "Waiting for the shard and eval bundle downloads to finish..."
wait "$DATASET_DOWNLOAD_PID"
wait "$BUNDLE_DOWNLOAD_PID"
python -m scripts.tok_eval  # compression on the training and (now final) validation shard

# -----------------------------------------------------------------------------
# Pretraining: d20 (1280 wide, 10 heads of 128, T=2048, SSSL windows), 524,288 tokens per step split
# over all GPUs (32 rows of 2048 per GPU on 8 GPUs, no accumulation), val bpb every 250 steps,
# CORE every 2000, a checkpoint every 1000 steps (the newest two kept). If it stops (preemption, SIGTERM), run the same line
# again: --resume-from-step=latest continues from the newest checkpoint, exactly.
# Less GPU memory: --device-batch-size=16 (gradient accumulation keeps the 524,288-token batch).
python -m scripts.train --depth=20 --save-every=1000 --keep-checkpoints=2 --resume-from-step=latest --run="$WANDB_RUN"

# -----------------------------------------------------------------------------
# Evaluation of the final checkpoint: bits per byte on 10M tokens of train and val (with greedy
# completions of fixed prompts), CORE on all 22 tasks, a few free samples
python -m scripts.base_loss
python -m scripts.base_eval
python -m scripts.sample -p "The capital of France is" -n 3 -m 64

# -----------------------------------------------------------------------------
python -m jaxchat.report generate
