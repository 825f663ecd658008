#!/usr/bin/env bash
# From a fresh clone to a trained, evaluated and sampled GPT on a laptop's CPU, with nothing downloaded
# beyond Python packages: the corpus is the prose that ships with Python (the standard library's
# docstrings, ~2 MB). All of nanochat's pipeline, shrunk: tokenizer, pretraining, bits per byte,
# samples, report. The model is tiny and sees ~0.5M tokens, so expect text-like phrases, not facts.
#
#   bash runs/cpu_demo.sh
#
# Environment:
#   JAXCHAT_BASE_DIR     where data, tokenizer, checkpoints and the report go (default: ~/.cache/jaxchat-cpu-demo,
#                        jaxchat.common.DEMO_BASE_DIR, apart from the other commands' ~/.cache/jaxchat so that the
#                        demo's --overwrite never replaces a GPU run's data or model). It ends by printing the
#                        commands that carry on from its model, with JAXCHAT_BASE_DIR set.
#   JAXCHAT_DEMO_SIZE    small (default: d4, 120 steps, minutes on 2 cores) or tiny (d2, seconds: for CI)
#   JAXCHAT_DEMO_PYTHON  a Python that already has jaxchat installed: use it instead of making .venv (the tests)
set -euo pipefail
cd "$(dirname "$0")/.."

export JAX_PLATFORMS=cpu  # a CPU demo, even where a GPU build of JAX is installed
export PYTHONUNBUFFERED=1

# -----------------------------------------------------------------------------
# Python environment
if [ -n "${JAXCHAT_DEMO_PYTHON:-}" ]; then
    PYTHON="$JAXCHAT_DEMO_PYTHON"
    ACTIVATE="the Python the demo ran with: $JAXCHAT_DEMO_PYTHON"
else
    [ -d .venv ] || python3 -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e .
    PYTHON=.venv/bin/python
    ACTIVATE="the demo's environment: . $PWD/.venv/bin/activate"
fi

demo_base_dir=$("$PYTHON" -c 'import os; from jaxchat.common import DEMO_BASE_DIR; print(os.path.expanduser(DEMO_BASE_DIR))')
export JAXCHAT_BASE_DIR="${JAXCHAT_BASE_DIR:-$demo_base_dir}"
mkdir -p "$JAXCHAT_BASE_DIR"

# -----------------------------------------------------------------------------
# Sizes. Learning rates: base_train.py multiplies every learning rate by sqrt(total_batch_size / 2^19),
# which for these tiny batches would shrink them 11-32x; the flags below are nanochat's defaults divided
# by that factor, so the effective rates are the ones nanochat trains with.
case "${JAXCHAT_DEMO_SIZE:-small}" in
    small)  # 120 steps of 4,096 tokens: 3-5 minutes of training on 2 x86 cores (docs/benchmarks.md)
        VOCAB_SIZE=8192; DEPTH=4; SEQ_LEN=512; DEVICE_BATCH=8; STEPS=120; EVAL_EVERY=30; EVAL_TOKENS=32768
        SAMPLE_TOKENS=48 ;;
    tiny)   # a smoke test of every stage: the model learns a little, nothing more
        VOCAB_SIZE=1024; DEPTH=2; SEQ_LEN=128; DEVICE_BATCH=4; STEPS=40; EVAL_EVERY=20; EVAL_TOKENS=2048
        SAMPLE_TOKENS=8 ;;
    *) echo "JAXCHAT_DEMO_SIZE must be small or tiny, got '$JAXCHAT_DEMO_SIZE'" >&2; exit 2 ;;
esac
TOTAL_BATCH=$((DEVICE_BATCH * SEQ_LEN))  # one sequence batch per step, no accumulation
lr() { awk -v lr="$1" -v batch="$TOTAL_BATCH" 'BEGIN { printf "%.4g", lr * sqrt(524288 / batch) }'; }

echo "jaxchat CPU demo (${JAXCHAT_DEMO_SIZE:-small}): base dir $JAXCHAT_BASE_DIR, $("$PYTHON" --version)"
"$PYTHON" -m jaxchat.report reset

# -----------------------------------------------------------------------------
# Data and tokenizer: the built-in corpus (9 training shards + 1 validation shard), a BPE on all of it.
# Documents of at most 2,000 characters (~500 tokens, one row): with the default 10,000 there are fewer
# documents than the loader's 1,000-document packing buffer, which then holds copies of the same text.
"$PYTHON" -m jaxchat.dataset --builtin --overwrite --max-doc-chars=2000
"$PYTHON" -m scripts.tok_train --vocab-size="$VOCAB_SIZE"
"$PYTHON" -m scripts.tok_eval --no-compare  # (the comparison with GPT-2/GPT-4 would download their vocabularies)

# -----------------------------------------------------------------------------
# Pretraining on the CPU, validation bpb every EVAL_EVERY steps (the report's curve); no CORE (it needs a
# 162 MB download) and no samples during training (base_loss draws them below). --overwrite: a rerun of
# the demo replaces the model of its previous run (whose tokenizer was just retrained).
"$PYTHON" -m scripts.train --device-type=cpu --depth="$DEPTH" --max-seq-len="$SEQ_LEN" \
    --device-batch-size="$DEVICE_BATCH" --total-batch-size="$TOTAL_BATCH" --num-iterations="$STEPS" \
    --eval-every="$EVAL_EVERY" --eval-tokens="$EVAL_TOKENS" --core-metric-every=-1 --sample-every=-1 \
    --matrix-lr="$(lr 0.02)" --embedding-lr="$(lr 0.3)" --unembedding-lr="$(lr 0.004)" --scalar-lr="$(lr 0.5)" \
    --loader-workers=2 --overwrite

# -----------------------------------------------------------------------------
# Evaluation: bits per byte on training and validation text (the same validation tokens as training's
# evaluations, so its val bpb is the last one of the curve), greedy completions of fixed prompts, then
# free samples at temperature 0.8
"$PYTHON" -m scripts.base_loss --device-type=cpu --device-batch-size="$DEVICE_BATCH" --split-tokens="$EVAL_TOKENS"
"$PYTHON" -m scripts.sample --device-type=cpu -p "The module" -n 3 -m "$SAMPLE_TOKENS" -t 0.8

# -----------------------------------------------------------------------------
"$PYTHON" -m jaxchat.report generate

# What a user tries next, each line as it works (tests/test_cpu_demo.py runs the sample and export lines as
# printed). The other commands' default base directory is ~/.cache/jaxchat, hence the prefix.
base="JAXCHAT_BASE_DIR=$(printf %q "$JAXCHAT_BASE_DIR")"
cat <<NEXT

The demo's model, tokenizer, data and report are in $JAXCHAT_BASE_DIR; every other command looks in
~/.cache/jaxchat unless JAXCHAT_BASE_DIR says otherwise. To carry on from this model, in $ACTIVATE
$base python -m scripts.sample -p "The module"
$base python -m scripts.base_loss --device-batch-size=$DEVICE_BATCH --split-tokens=$EVAL_TOKENS
$base python -m scripts.base_eval --max-per-task=100   # CORE: downloads DCLM's 162 MB eval bundle first
pip install torch --index-url https://download.pytorch.org/whl/cpu   # PyTorch's CPU build (0.7 GB installed), for nanochat's .pt files
$base python -m scripts.export --to-nanochat $(printf %q "$JAXCHAT_BASE_DIR/nanochat")
NEXT
