#!/usr/bin/env bash
# nanochat's base-model speedrun on one GPU host (8 x H100 is the reference): install, download
# FineWeb-Edu, train the 65,536-token tokenizer, pretrain d20 on every GPU of the host, then bits per
# byte, CORE, samples and the report. One JAX process drives all local GPUs (no torchrun).
#
#   bash runs/speedrun.sh
#   screen -L -Logfile speedrun.log -S speedrun bash runs/speedrun.sh      # it runs for hours
#   WANDB_RUN=d20 bash runs/speedrun.sh                                      # log to wandb (after `wandb login`)
#   RECIPE=92d63d4 bash runs/speedrun.sh                                     # nanochat's current speedrun
#
# RECIPE picks which speedrun: bdcc030 (the seed's: FineWeb-Edu, 65,536-token tokenizer, d20 at ratio 8)
# or 92d63d4 (nanochat's runs/speedrun.sh at that commit: ClimbMix, 32,768-token tokenizer, d24 at ratio 8,
# device batch 16, fp8, the batch size by its rule).
#
# Everything goes to $JAXCHAT_BASE_DIR (default ~/.cache/jaxchat): about 16 GB of shards, the tokenizer,
# checkpoints (5.2 GB each: float32 parameters and optimizer state), the report. Several hosts: runs/multihost_slurm.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

export JAXCHAT_BASE_DIR="${JAXCHAT_BASE_DIR:-$HOME/.cache/jaxchat}"
export PYTHONUNBUFFERED=1
WANDB_RUN="${WANDB_RUN:-dummy}"  # 'dummy' logs nothing to wandb
RECIPE="${RECIPE:-bdcc030}"
case "$RECIPE" in
  bdcc030) CORPUS=fineweb-edu; DATA_DIR="$JAXCHAT_BASE_DIR/base_data"; VOCAB_SIZE=65536
           TRAIN_FLAGS=(--depth=20) ;;
  92d63d4) CORPUS=climbmix; DATA_DIR="$JAXCHAT_BASE_DIR/base_data_climbmix"; VOCAB_SIZE=32768
           TRAIN_FLAGS=(--recipe=92d63d4 --depth=24 --target-param-data-ratio=8 --device-batch-size=16 --fp8) ;;
  *) echo "RECIPE=$RECIPE: use bdcc030 or 92d63d4" >&2; exit 2 ;;
esac
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
# Data. The tokenizer trains on the first 2B characters: 2e9 / 250M characters per shard = 8 shards
# (plus, for FineWeb-Edu, one more because the last shard present is the validation split; ClimbMix's
# validation shard, shard_06542, is always fetched).
if [ "$RECIPE" = bdcc030 ]; then python -m jaxchat.dataset -n 9; else python -m jaxchat.dataset -n 8 --corpus climbmix; fi
# The shards pretraining needs (nanochat's arithmetic in its speedrun.sh):
# bdcc030, d20:
#   d20 has 560,988,200 parameters; the default --target-param-data-ratio=8 gives
#   8 x 560,988,200 // 524,288 = 8,559 steps of 524,288 tokens = 4.49B tokens.
#   At ~4.8 characters per token (the 65,536-token tokenizer on FineWeb-Edu) that is 21.5B characters.
#   Best-fit packing crops ~35% of the tokens it reads at T=2048 (nanochat's figure), so the loader reads
#   21.5B / 0.65 = 33.1B characters = 133 shards of 250M characters; + 1 validation shard = 134.
#   Rounded up to 150 for margin (~100 MB each, ~15 GB). (An epoch counter above 1 in the step
#   lines means the loader wrapped around: download more with a larger -n and resume.)
# 92d63d4, d24 at ratio 8:
#   scaling parameters (transformer matrices + lm_head) 24 x 12 x 1536^2 + 12 value-embedding gates of
#   12 x 12 + 32,768 x 1536 = 729,810,624; target 8 x that = 5,838,484,992 tokens. d12's: 110,100,912,
#   D_ref = 880,807,296; the batch 2^19 x (5.84B / 0.881B)^0.383 = 2^20.05 -> 2^20 = 1,048,576 tokens,
#   5,838,484,992 // 1,048,576 = 5,568 steps = 5.84B tokens. nanochat downloads 170 ClimbMix shards for it
#   ("approximately 150 ... add 20 for padding"); its characters per token are not measured here.
if [ "$RECIPE" = bdcc030 ]; then NUM_SHARDS=150; else NUM_SHARDS=170; fi
python -m jaxchat.dataset -n "$NUM_SHARDS" --corpus "$CORPUS" &
DATASET_DOWNLOAD_PID=$!
# The CORE eval bundle (~162 MB) meanwhile; on the CPU backend, so that it holds no GPU memory
JAX_PLATFORMS=cpu python -c "from jaxchat.eval.core import download_eval_bundle; download_eval_bundle()" &
BUNDLE_DOWNLOAD_PID=$!

# Tokenizer: vocabulary 2^16 = 65,536 (bdcc030) or 2^15 = 32,768 (92d63d4) on ~2B characters
python -m scripts.tok_train --max-chars=2000000000 --vocab-size="$VOCAB_SIZE" --data-dir="$DATA_DIR"

echo "Waiting for the shard and eval bundle downloads to finish..."
wait "$DATASET_DOWNLOAD_PID"
wait "$BUNDLE_DOWNLOAD_PID"
python -m scripts.tok_eval --data-dir="$DATA_DIR"  # compression on the training and (now final) validation shard

# -----------------------------------------------------------------------------
# Pretraining: d20 (1280 wide, 10 heads of 128, T=2048, SSSL windows), 524,288 tokens per step split
# over all GPUs (32 rows of 2048 per GPU on 8 GPUs, no accumulation), val bpb every 250 steps,
# CORE every 2000, a checkpoint every 1000 steps (the newest two kept). If it stops (preemption, SIGTERM), run the same line
# again: --resume-from-step=latest continues from the newest checkpoint, exactly.
# Less GPU memory: --device-batch-size=16 (gradient accumulation keeps the 524,288-token batch).
# 92d63d4: d24 (1536 wide, 12 heads), the batch of its rule (1,048,576 tokens; 16 rows x 2048 x 8 GPUs =
# 262,144 tokens per micro-step, so 4 micro-steps accumulated), training on ClimbMix.
python -m scripts.train "${TRAIN_FLAGS[@]}" --save-every=1000 --keep-checkpoints=2 --resume-from-step=latest \
  --run="$WANDB_RUN"

# -----------------------------------------------------------------------------
# Evaluation of the final checkpoint: bits per byte on 10M tokens of train and val (with greedy
# completions of fixed prompts), CORE on all 22 tasks, a few free samples
python -m scripts.base_loss --data-dir="$DATA_DIR"
python -m scripts.base_eval
python -m scripts.sample -p "The capital of France is" -n 3 -m 64

# -----------------------------------------------------------------------------
python -m jaxchat.report generate
