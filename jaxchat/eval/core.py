"""The CORE metric (DCLM, arXiv 2406.11794): 22 in-context tasks scored with a base model.

Prompts, few-shot draws, shuffling, cropping and the scoring rules follow nanochat's core_eval example
for example, so the numbers compare with nanochat's. What differs is how the model runs: nanochat
forwards one example at a time; here the scored rows (one per choice) of many examples are padded to
a few bucket lengths (powers of two) and go through one jitted function in large batches sharded over
every device, so the model compiles once per bucket rather than once per example shape.

Task types (each row is BOS + prompt; the "continuation" is the scored span of the row):
- multiple_choice: same question, one row per choice; the continuation starts where the rows diverge.
  Prediction: the row with the lowest mean loss over its continuation.
- schema: one row per context, same ending; the continuation is the common suffix. Same rule.
- language_modeling: one row; correct iff the greedy prediction equals every continuation token.
"""

import csv
import fcntl
import json
import os
import random
import tempfile
import time
import zipfile
from collections import deque
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jinja2 import Template

from jaxchat.common import Progress, eta_text, local_dir, print0
from jaxchat.data.download import DownloadError, OfflineError, fetch
from jaxchat.model.gpt import ROTARY_LENGTH_FACTOR
from jaxchat.distributed.mesh import params_mesh, rows_partitioned

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
EVAL_BUNDLE_URL_ENV = "JAXCHAT_EVAL_BUNDLE_URL"  # a mirror, or a local server in tests
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
MIN_BUCKET = 64  # shortest padded row length; buckets grow from here up to the model's limit
FEWSHOT_SEED = 1234  # few-shot examples of item idx come from random.Random(1234 + idx)
SHUFFLE_SEED = 1337  # task data is shuffled with random.Random(1337) before cropping to max_per_task


# -----------------------------------------------------------------------------------------------
# The eval bundle: core.yaml (tasks), eval_data/*.jsonl (examples), eval_meta_data.csv (baselines)

def download_eval_bundle(base_dir: str | None = None, url: str | None = None) -> str:
    """<base_dir>/eval_bundle (jaxchat.common.local_dir: a local folder where the base dir is a bucket), downloaded
    and unpacked from url (default: $JAXCHAT_EVAL_BUNDLE_URL, else
    nanochat's public copy) on first use (about 162 MB). A file lock makes concurrent processes wait for
    one download instead of racing for it."""
    url = url or os.environ.get(EVAL_BUNDLE_URL_ENV) or EVAL_BUNDLE_URL
    base_dir = base_dir or local_dir()
    bundle_dir = os.path.join(base_dir, "eval_bundle")
    if _bundle_complete(bundle_dir):
        return bundle_dir
    os.makedirs(base_dir, exist_ok=True)
    with open(os.path.join(base_dir, "eval_bundle.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _bundle_complete(bundle_dir):  # another process finished while we waited
            return bundle_dir
        if os.path.exists(bundle_dir):
            raise RuntimeError(f"{bundle_dir} exists but has no core.yaml; delete it so that it can be downloaded again")
        # Download and unpack next to the target, then rename: a crash never leaves a half bundle behind.
        with tempfile.TemporaryDirectory(dir=base_dir, prefix="eval_bundle.tmp") as tmp:
            zip_path = os.path.join(tmp, "eval_bundle.zip")
            print0(f"Downloading the CORE eval bundle from {url} to {bundle_dir}")
            try:
                fetch(url, zip_path, label="eval bundle")
            except DownloadError as e:  # (an OfflineError says the network is unreachable: not retried)
                reason = e.reason if isinstance(e, OfflineError) else e.__cause__
                raise RuntimeError(
                    f"could not download the CORE eval bundle from {url} ({reason}). Without internet access, "
                    f"fetch that file on another machine and unzip it into {base_dir}, so that "
                    f"{bundle_dir}/core.yaml exists.") from e
            with zipfile.ZipFile(zip_path) as archive:
                archive.extractall(tmp)
            if not _bundle_complete(os.path.join(tmp, "eval_bundle")):
                raise RuntimeError(f"{url} is not an eval bundle: it has no eval_bundle/core.yaml")
            os.replace(os.path.join(tmp, "eval_bundle"), bundle_dir)
    return bundle_dir


def _bundle_complete(bundle_dir: str) -> bool:
    return os.path.exists(os.path.join(bundle_dir, "core.yaml"))


@dataclass
class CoreTask:
    label: str
    task_type: str  # one of TASK_TYPES
    num_fewshot: int
    continuation_delimiter: str
    random_baseline: float  # accuracy of chance, in percent (eval_meta_data.csv)
    data: list[dict]  # shuffled with SHUFFLE_SEED, cropped to max_per_task


def load_core_tasks(bundle_dir: str, max_per_task: int = -1) -> list[CoreTask]:
    """The tasks of core.yaml with their examples; max_per_task > 0 keeps that many per task."""
    with open(os.path.join(bundle_dir, "core.yaml"), encoding="utf-8") as f:
        task_configs = yaml.safe_load(f)["icl_tasks"]
    with open(os.path.join(bundle_dir, "eval_meta_data.csv"), encoding="utf-8") as f:
        baselines = {row["Eval Task"]: float(row["Random baseline"]) for row in csv.DictReader(f)}
    tasks = []
    for config in task_configs:
        label, task_type = config["label"], config["icl_task_type"]
        if task_type not in TASK_TYPES:
            raise ValueError(f"task {label}: unknown icl_task_type {task_type!r}, expected one of {TASK_TYPES}")
        if label not in baselines:
            raise ValueError(f"task {label} has no 'Random baseline' row in {bundle_dir}/eval_meta_data.csv")
        with open(os.path.join(bundle_dir, "eval_data", config["dataset_uri"]), encoding="utf-8") as f:
            data = [json.loads(line) for line in f if line.strip()]
        random.Random(SHUFFLE_SEED).shuffle(data)
        if max_per_task > 0:
            data = data[:max_per_task]
        tasks.append(CoreTask(label, task_type, config["num_fewshot"][0],
                              config.get("continuation_delimiter", " "), baselines[label], data))
    return tasks


# -----------------------------------------------------------------------------------------------
# Prompts. The templates reproduce nanochat's exactly (whitespace control included): few-shot
# examples each followed by a blank line, then the item. Compiled once, not once per example.

_MC_TEMPLATE = Template(
    "{%- for example in fewshot_examples -%}\n"
    "{{ example.query }}{{ continuation_delimiter }}{{ example.choices[example.gold] }}\n\n"
    "{% endfor -%}\n"
    "{{ item.query }}{{ continuation_delimiter }}{{ choice }}"
)
_SCHEMA_TEMPLATE = Template(
    "{%- for example in fewshot_examples -%}\n"
    "{{ example.context_options[example.gold] }}{{ continuation_delimiter }}{{ example.continuation }}\n\n"
    "{% endfor -%}\n"
    "{{ context }}{{ continuation_delimiter }}{{ item.continuation }}"
)
# Contexts are trimmed: some datasets carry trailing whitespace that would merge into the next token.
_LM_TEMPLATE = Template(
    "{%- for example in fewshot_examples -%}\n"
    "{{ example.context | trim }}{{ continuation_delimiter }}{{ example.continuation }}\n\n"
    "{% endfor -%}\n"
    "{{ item.context | trim }}{{ continuation_delimiter }}"
    "{% if include_continuation %}{{ item.continuation }}{% endif %}"
)


def render_prompts_mc(item: dict, continuation_delimiter: str, fewshot_examples: list[dict]) -> list[str]:
    """One prompt per choice."""
    ctx = dict(item=item, continuation_delimiter=continuation_delimiter, fewshot_examples=fewshot_examples)
    return [_MC_TEMPLATE.render(choice=choice, **ctx) for choice in item["choices"]]


def render_prompts_schema(item: dict, continuation_delimiter: str, fewshot_examples: list[dict]) -> list[str]:
    """One prompt per context option."""
    ctx = dict(item=item, continuation_delimiter=continuation_delimiter, fewshot_examples=fewshot_examples)
    return [_SCHEMA_TEMPLATE.render(context=option, **ctx) for option in item["context_options"]]


def render_prompts_lm(item: dict, continuation_delimiter: str, fewshot_examples: list[dict]) -> list[str]:
    """[prompt without the continuation (stripped), prompt with it]. Stripping the first keeps it a
    clean token prefix of the second (a trailing space would merge into the continuation's first token)."""
    ctx = dict(item=item, continuation_delimiter=continuation_delimiter, fewshot_examples=fewshot_examples)
    without = _LM_TEMPLATE.render(include_continuation=False, **ctx).strip()
    return [without, _LM_TEMPLATE.render(include_continuation=True, **ctx)]


_RENDERERS = {"multiple_choice": render_prompts_mc, "schema": render_prompts_schema,
              "language_modeling": render_prompts_lm}


def fewshot_indices(idx: int, num_items: int, num_fewshot: int) -> list[int]:
    """nanochat's draw: random.Random(1234 + idx).sample(the indices other than idx, num_fewshot).
    Sampling positions in range(num_items - 1) and stepping over idx picks the same indices without
    building that list for every item (quadratic in the task size)."""
    if num_fewshot > num_items - 1:
        raise ValueError(f"{num_fewshot}-shot prompts need at least {num_fewshot + 1} examples, the task has "
                         f"{num_items}; use a larger max_per_task")
    picks = random.Random(FEWSHOT_SEED + idx).sample(range(num_items - 1), num_fewshot)
    return [j + (j >= idx) for j in picks]


def render_example(task: CoreTask, idx: int) -> list[str]:
    fewshot = [task.data[j] for j in fewshot_indices(idx, len(task.data), task.num_fewshot)]
    return _RENDERERS[task.task_type](task.data[idx], task.continuation_delimiter, fewshot)


def common_length(rows: list[list[int]], from_end: bool = False) -> int:
    """Length of the prefix (or suffix) shared by all rows."""
    shortest = min(len(row) for row in rows)
    for i in range(shortest):
        pos = -1 - i if from_end else i
        if any(row[pos] != rows[0][pos] for row in rows):
            return i
    return shortest


@dataclass
class ScoredRows:
    """The rows of one example and where each one's continuation lies: rows[i][starts[i]:ends[i]]."""

    rows: list[list[int]]
    starts: list[int]
    ends: list[int]


def locate_continuations(task_type: str, rows: list[list[int]]) -> ScoredRows:
    """rows: the tokenized prompts of one example (BOS first), as the renderer of task_type made them."""
    ends = [len(row) for row in rows]
    if task_type == "multiple_choice":
        start = common_length(rows)  # the choices begin where the rows diverge
        return ScoredRows(rows, [start] * len(rows), ends)
    if task_type == "schema":
        suffix = common_length(rows, from_end=True)  # the shared ending is what gets scored
        return ScoredRows(rows, [end - suffix for end in ends], ends)
    without, with_continuation = rows
    if not (len(without) < len(with_continuation) and with_continuation[: len(without)] == without):
        raise ValueError("language_modeling: the prompt without the continuation does not tokenize to a "
                         "prefix of the prompt with it")
    return ScoredRows([with_continuation], [len(without)], [len(with_continuation)])


def crop_left(scored: ScoredRows, max_len: int) -> ScoredRows:
    """Rows longer than max_len keep their last max_len tokens (the start of the few-shot context goes)."""
    rows, starts, ends = [], [], []
    for row, start, end in zip(scored.rows, scored.starts, scored.ends):
        crop = max(0, len(row) - max_len)
        if start - crop < 1:
            raise ValueError(f"a continuation of {end - start} tokens does not fit in the model's {max_len} positions")
        rows.append(row[crop:])
        starts.append(start - crop)
        ends.append(end - crop)
    return ScoredRows(rows, starts, ends)


def encode_task(task: CoreTask, tokenizer, max_len: int) -> list[ScoredRows]:
    """Every example of the task as BOS-prefixed token rows, cropped to max_len. All prompts of the
    task are tokenized in one batched call (the tokenizer's threads then have work to share)."""
    prompts = [render_example(task, idx) for idx in range(len(task.data))]
    flat = tokenizer.encode([p for example in prompts for p in example], prepend=tokenizer.get_bos_token_id())
    examples, offset = [], 0
    for example in prompts:
        rows = flat[offset: offset + len(example)]
        offset += len(example)
        examples.append(crop_left(locate_continuations(task.task_type, rows), max_len))
    return examples


def is_correct(task_type: str, gold: int | None, mean_losses: list[float], all_predicted: bool) -> bool:
    """nanochat's rules: language_modeling needs every continuation token predicted greedily; the others
    pick the first row of lowest mean loss (Python's min/index, so a NaN scores as nanochat's would)."""
    if task_type == "language_modeling":
        return all_predicted
    return mean_losses.index(min(mean_losses)) == gold


def centered_score(accuracy: float, random_baseline: float) -> float:
    """0 at chance, 1 at perfect; random_baseline is in percent."""
    return (accuracy - 0.01 * random_baseline) / (1.0 - 0.01 * random_baseline)


# -----------------------------------------------------------------------------------------------
# Scoring on device

def bucket_length(n: int, max_len: int, midpoints: bool = False) -> int:
    """The padded length of a row of n tokens, at most max_len: the smallest power of two from 64 up
    that holds it, or with midpoints also 96, 192, 384, ... (1.5x the power below): twice the
    compilations, but at most a third of a batch is padding instead of half."""
    power = max(MIN_BUCKET, 1 << (n - 1).bit_length())
    if midpoints and power > MIN_BUCKET and n <= power * 3 // 4:
        power = power * 3 // 4
    return min(power, max_len)


@partial(jax.jit, static_argnums=(0, 1))
def _score_rows(graphdef, replicated, state, tokens, starts, ends):
    """tokens: (R, L) rows padded on the right. Per row: the mean loss over positions starts-1 ..
    ends-2 (each predicting the next token: the continuation) and whether the argmax prediction equals
    every continuation token. Padding rows have starts == ends (empty span) and are ignored by the host."""
    model = nnx.merge(graphdef, state)
    targets = jnp.roll(tokens, -1, axis=1)  # position p predicts token p + 1
    with rows_partitioned(replicated.mesh):
        losses, predicted = model.token_scores(tokens, targets)  # the loss head in chunks: no (R, L, V) logits
    positions = jnp.arange(tokens.shape[1])[None, :]
    in_span = (positions >= starts[:, None] - 1) & (positions < ends[:, None] - 1)
    mean_losses = jnp.where(in_span, losses, 0.0).sum(axis=1) / in_span.sum(axis=1)
    all_predicted = jnp.all(predicted | ~in_span, axis=1)
    # Every process reads every row's result: gather them inside the computation.
    return jax.lax.with_sharding_constraint((mean_losses, all_predicted), replicated)


def default_max_len(model) -> int:
    """The longest row the model takes: its rotary range (10x the training length), as in nanochat,
    whose GPT has no max_seq_len and so never crops."""
    return ROTARY_LENGTH_FACTOR * model.config.sequence_len


class RowScorer:
    """Scores token rows with a model: rows are bucketed by length, packed into fixed (rows, length)
    batches sharded over every device of the mesh, and fetched two batches behind the dispatch, so the
    device always has queued work while the host packs the next batch."""

    def __init__(self, model: nnx.Module, pad_id: int, max_len: int, mesh: Mesh | None = None,
                 tokens_per_device: int = 8192, midpoint_buckets: bool | None = None):
        self.graphdef, self.state = nnx.split(model)
        # Which costs more decides the buckets: on CPU the forward itself (a d4 run went ~1.5x faster
        # with midpoints), on accelerators compiling a deep model once per bucket.
        self.midpoint_buckets = jax.default_backend() == "cpu" if midpoint_buckets is None else midpoint_buckets
        self.mesh = mesh or params_mesh(self.state)
        self.rows_sharding = NamedSharding(self.mesh, PartitionSpec(self.mesh.axis_names))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.pad_id, self.max_len, self.tokens_per_device = pad_id, max_len, tokens_per_device

    def rows_per_batch(self, length: int) -> int:
        return self.mesh.size * max(1, self.tokens_per_device // length)

    def score(self, examples: list[ScoredRows], on_progress=None) -> tuple[list[list[float]], list[bool]]:
        """Per example: the mean continuation loss of each row, and whether its first row's continuation
        is predicted exactly. on_progress(rows_done) is called as batches complete."""
        flat = [(e, i) for e, ex in enumerate(examples) for i in range(len(ex.rows))]
        buckets: dict[int, list[int]] = {}
        for r, (e, i) in enumerate(flat):
            length = bucket_length(len(examples[e].rows[i]), self.max_len, self.midpoint_buckets)
            buckets.setdefault(length, []).append(r)
        mean_losses = np.zeros(len(flat), np.float32)
        all_predicted = np.zeros(len(flat), bool)
        pending, done = deque(), 0

        def collect():
            nonlocal done
            row_ids, (losses, predicted) = pending.popleft()
            mean_losses[row_ids] = np.asarray(losses)[: len(row_ids)]
            all_predicted[row_ids] = np.asarray(predicted)[: len(row_ids)]
            done += len(row_ids)
            if on_progress:
                on_progress(done)

        for length, row_ids in sorted(buckets.items()):
            R = self.rows_per_batch(length)
            for b in range(0, len(row_ids), R):
                chunk = row_ids[b: b + R]
                tokens = np.full((R, length), self.pad_id, np.int32)
                starts = np.ones(R, np.int32)
                ends = np.ones(R, np.int32)
                for j, r in enumerate(chunk):
                    e, i = flat[r]
                    row = examples[e].rows[i]
                    tokens[j, : len(row)] = row
                    starts[j], ends[j] = examples[e].starts[i], examples[e].ends[i]
                batch = [self._put(x) for x in (tokens, starts, ends)]
                pending.append((chunk, _score_rows(self.graphdef, self.replicated, self.state, *batch)))
                if len(pending) > 2:
                    collect()
        while pending:
            collect()

        per_example_losses, first_predicted, r = [], [], 0
        for ex in examples:
            n = len(ex.rows)
            per_example_losses.append([float(x) for x in mean_losses[r: r + n]])
            first_predicted.append(bool(all_predicted[r]))
            r += n
        return per_example_losses, first_predicted

    def _put(self, x: np.ndarray) -> jax.Array:
        # Every process holds the whole batch (all of them tokenized every example), so each one
        # hands over just the slices its own devices own.
        return jax.make_array_from_callback(x.shape, self.rows_sharding, lambda index: x[index])


def evaluate_task(scorer: RowScorer, task: CoreTask, tokenizer, progress: "Progress | None" = None) -> float:
    """Accuracy of the model on one task."""
    examples = encode_task(task, tokenizer, scorer.max_len)
    total_rows, start = sum(len(ex.rows) for ex in examples), time.time()

    def show(done: int) -> None:
        elapsed = time.time() - start
        progress.status(f"{task.label}: {done}/{total_rows} rows | {done / max(elapsed, 1e-9):.1f} rows/s | "
                        f"{eta_text(done, total_rows, elapsed)}")

    losses, predicted = scorer.score(examples, show if progress else None)
    golds = [item.get("gold") for item in task.data]
    correct = [is_correct(task.task_type, g, l, p) for g, l, p in zip(golds, losses, predicted)]
    return sum(correct) / len(correct)


def evaluate_core(model: nnx.Module, tokenizer, max_per_task: int = -1, bundle_dir: str | None = None,
                  max_len: int | None = None, mesh: Mesh | None = None, tokens_per_device: int = 8192,
                  midpoint_buckets: bool | None = None) -> dict:
    """CORE of a model: {'results': accuracy per task, 'centered_results': centered accuracy per task,
    'core_metric': their mean}. Every process must call it (the batches span all devices).
    bundle_dir: default <base_dir>/eval_bundle, downloaded on first use. max_len: rows are left-cropped
    to it (default: the model's rotary range). tokens_per_device: batch size, in padded tokens per device.
    midpoint_buckets: pad rows to 1.5x steps as well as powers of two (default: on CPU only)."""
    bundle_dir = bundle_dir or download_eval_bundle()
    tasks = load_core_tasks(bundle_dir, max_per_task)
    scorer = RowScorer(model, tokenizer.get_bos_token_id(), max_len or default_max_len(model), mesh,
                       tokens_per_device, midpoint_buckets)
    progress = Progress()
    results, centered_results = {}, {}
    for task in tasks:
        t0 = time.time()
        accuracy = evaluate_task(scorer, task, tokenizer, progress)
        results[task.label] = accuracy
        centered_results[task.label] = centered_score(accuracy, task.random_baseline)
        progress.line(f"{task.label:<35} {task.num_fewshot:>2}-shot {task.task_type:<17} | "
                             f"accuracy {accuracy:.4f} | centered {centered_results[task.label]:.4f} | "
                             f"{len(task.data)} examples | {time.time() - t0:.1f}s")
    core_metric = sum(centered_results.values()) / len(centered_results)
    progress.close(f"CORE metric: {core_metric:.4f} over {len(tasks)} tasks")
    return {"results": results, "centered_results": centered_results, "core_metric": core_metric}
