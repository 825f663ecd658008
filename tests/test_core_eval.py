"""CORE against a plain-Python reference of nanochat's rules: prompt rendering, few-shot draws,
shuffling, cropping, scoring, centered scores; a tiny real GPT end to end; the bundle download."""

import csv
import http.server
import json
import math
import os
import random
import socket
import threading
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxchat.eval import core as core_eval

from jaxchat.data import download
from jaxchat.eval.core import (
    download_eval_bundle,
    evaluate_core,
    fewshot_indices,
    load_core_tasks,
    render_prompts_lm,
    render_prompts_mc,
    render_prompts_schema,
)
from jaxchat.model.gpt import GPTConfig
from jaxchat.export.nanochat import to_nanochat_state_dict
from jaxchat.data.tokenizer import Tokenizer
from nanochat_numpy import np_forward, randomized

# ---- a small bundle in the real format ----------------------------------------------------------
COLORS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
ANIMALS = ["cat", "dog", "horse", "bird", "fish", "mouse", "lion", "sheep", "goat", "duck"]


def mc_items(n: int) -> list[dict]:
    rng = random.Random(0)
    return [{"query": f"Question: what color is the {ANIMALS[i % len(ANIMALS)]} number {i}?\nAnswer:",
             "choices": rng.sample(COLORS, 3 + i % 2), "gold": i % 3} for i in range(n)]


def schema_items(n: int) -> list[dict]:
    return [{"context_options": [f"The {a} chased the {b} because it was hungry",
                                 f"The {b} chased the {a} because it was scared"],
             "continuation": f"and then the {ANIMALS[(i + 2) % len(ANIMALS)]} ran away.", "gold": i % 2}
            for i, (a, b) in enumerate(zip(ANIMALS * 2, ANIMALS[3:] + ANIMALS * 2))][:n]


def lm_items(n: int) -> list[dict]:
    # trailing whitespace in contexts, as some real datasets have: the template trims it
    return [{"context": f"The {ANIMALS[i % len(ANIMALS)]} is {COLORS[i % len(COLORS)]} and the sky is ",
             "continuation": f"{COLORS[(3 * i) % len(COLORS)]} today"} for i in range(n)]


TASKS = [  # label, type, items, few-shot, delimiter (None: the default), random baseline in percent
    ("mc_task", "multiple_choice", mc_items(13), 2, None, 30.0),
    ("schema_task", "schema", schema_items(11), 1, None, 50.0),
    ("lm_task", "language_modeling", lm_items(12), 3, "\nA: ", 0.0),
]


def write_bundle(bundle_dir: str) -> None:
    os.makedirs(os.path.join(bundle_dir, "eval_data"))
    lines = ["icl_tasks:"]
    for label, task_type, items, shots, delimiter, _ in TASKS:
        lines += [f"- label: {label}", f"  dataset_uri: {label}.jsonl", f"  num_fewshot: [{shots}]",
                  f"  icl_task_type: {task_type}"]
        if delimiter is not None:
            lines.append(f"  continuation_delimiter: {json.dumps(delimiter)}")
        with open(os.path.join(bundle_dir, "eval_data", f"{label}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(item) + "\n" for item in items)
    with open(os.path.join(bundle_dir, "core.yaml"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(bundle_dir, "eval_meta_data.csv"), "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Eval Task", "Task Category", "Task Type", "#shots", "#datapoints", "Random baseline"])
        for label, task_type, items, shots, _, baseline in TASKS:
            writer.writerow([label, "test", task_type, shots, len(items), baseline])


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("bundle") / "eval_bundle")
    write_bundle(path)
    return path


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    texts = [json.dumps(items) for _, _, items, *_ in TASKS] * 3
    return Tokenizer.train_from_iterator(iter(texts), 400)


# ---- a scoring model whose answers the test can compute by hand ----------------------------------
class PositionalBigram(nnx.Module):
    """logits[b, t] = table[token[b, t]] + position_bias[t]: the loss at t depends on the token at t,
    the next one and the absolute position, so padding, spans and left-cropping all show in the scores."""

    def __init__(self, table: np.ndarray, position_bias: np.ndarray):
        self.table = nnx.Param(jnp.asarray(table, jnp.float32))
        self.position_bias = nnx.Param(jnp.asarray(position_bias, jnp.float32))

    def __call__(self, idx):
        return self.table[idx] + self.position_bias[: idx.shape[1]][None]

    def token_scores(self, idx, targets):
        """What the scorer reads of a model (as GPT.token_scores): each token's loss and greedy hit."""
        logits = self(idx)
        target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - target_logits, jnp.argmax(logits, axis=-1) == targets


def reference_prompts(task_type: str, item: dict, delimiter: str, fewshot: list[dict]) -> list[str]:
    """nanochat's templates written out as plain string building."""
    if task_type == "multiple_choice":
        shots = "".join(f"{ex['query']}{delimiter}{ex['choices'][ex['gold']]}\n\n" for ex in fewshot)
        return [f"{shots}{item['query']}{delimiter}{choice}" for choice in item["choices"]]
    if task_type == "schema":
        shots = "".join(f"{ex['context_options'][ex['gold']]}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
        return [f"{shots}{ctx}{delimiter}{item['continuation']}" for ctx in item["context_options"]]
    shots = "".join(f"{ex['context'].strip()}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
    without = f"{shots}{item['context'].strip()}{delimiter}"
    return [without.strip(), without + item["continuation"]]


def reference_examples(task_type, items, shots, delimiter, tokenizer, max_len, max_per_task):
    """nanochat's data preparation one example at a time: [(rows, spans, gold)], spans = (start, end)
    of the scored continuation in each row."""
    data = list(items)
    random.Random(1337).shuffle(data)
    if max_per_task > 0:
        data = data[:max_per_task]
    bos = tokenizer.get_bos_token_id()
    examples = []
    for idx, item in enumerate(data):
        others = [i for i in range(len(data)) if i != idx]
        fewshot = [data[i] for i in random.Random(1234 + idx).sample(others, shots)]
        rows = [[bos] + tokenizer.encode(p) for p in reference_prompts(task_type, item, delimiter, fewshot)]
        if task_type == "multiple_choice":  # choices start where the rows diverge
            start = next(i for i in range(min(map(len, rows))) if len({r[i] for r in rows}) > 1)
            spans = [(start, len(r)) for r in rows]
        elif task_type == "schema":  # the common suffix is scored
            suffix = next(i for i in range(min(map(len, rows))) if len({r[-1 - i] for r in rows}) > 1)
            spans = [(len(r) - suffix, len(r)) for r in rows]
        else:
            assert rows[1][: len(rows[0])] == rows[0]
            spans, rows = [(len(rows[0]), len(rows[1]))], [rows[1]]
        for i, row in enumerate(rows):  # keep the last max_len tokens
            crop = max(0, len(row) - max_len)
            rows[i], spans[i] = row[crop:], (spans[i][0] - crop, spans[i][1] - crop)
        examples.append((rows, spans, item.get("gold")))
    return examples


def reference_accuracy(task_type, examples, logits_of) -> tuple[float, float]:
    """nanochat's scoring of (rows, spans, gold) examples with float64 logits (logits_of(row): (len, V)):
    the accuracy, and the smallest decision margin (float32 on device must not flip a decision)."""
    correct, margin = [], math.inf
    for rows, spans, gold in examples:
        mean_losses, predicted = [], True
        for row, (s, e) in zip(rows, spans):
            logits = logits_of(row)[s - 1: e - 1]
            logz = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
            mean_losses.append(np.mean(logz - logits[np.arange(e - s), row[s:e]]))
            predicted &= bool(np.all(logits.argmax(1) == row[s:e]))
            if task_type == "language_modeling":  # a hit needs every position right, a miss one clearly wrong
                target = logits[np.arange(e - s), row[s:e]]
                others = logits.copy()
                others[np.arange(e - s), row[s:e]] = -np.inf
                gaps = target - others.max(1)  # > 0: the target is the argmax
                margin = min(margin, float(gaps.min() if np.all(gaps > 0) else -gaps.min()))
        if task_type == "language_modeling":
            correct.append(predicted)
        else:
            ranked = np.sort(mean_losses)
            margin = min(margin, ranked[1] - ranked[0])
            correct.append(int(np.argmin(mean_losses)) == gold)
    return sum(correct) / len(correct), margin


def make_bigram(vocab_size: int, length: int, lm_examples=(), seed: int = 0):
    """A random PositionalBigram that also knows the continuations of every other language-modeling
    example: their bigrams get a large bonus, so those are predicted exactly (unless another example
    needs the same first token to lead elsewhere: the reference finds out)."""
    rng = np.random.default_rng(seed)
    table = rng.normal(0, 1, (vocab_size, vocab_size))
    position_bias = rng.normal(0, 1, (length, vocab_size))
    for rows, spans, _ in lm_examples[::2]:
        (s, e), row = spans[0], rows[0]
        for p in range(s - 1, e - 1):
            table[row[p], row[p + 1]] += 15.0
    table, position_bias = table.astype(np.float32), position_bias.astype(np.float32)
    model = PositionalBigram(table, position_bias)
    return model, table.astype(np.float64), position_bias.astype(np.float64)


# ---- prompt rendering, few-shot draws, loading ---------------------------------------------------
def test_render_multiple_choice():
    item = {"query": "Q: 2+2?", "choices": ["4", "5"], "gold": 0}
    fewshot = [{"query": "Q: 1+1?", "choices": ["3", "2"], "gold": 1}, {"query": "Q: 0+0?", "choices": ["0"], "gold": 0}]
    assert render_prompts_mc(item, " A: ", fewshot) == [
        "Q: 1+1? A: 2\n\nQ: 0+0? A: 0\n\nQ: 2+2? A: 4",
        "Q: 1+1? A: 2\n\nQ: 0+0? A: 0\n\nQ: 2+2? A: 5",
    ]
    assert render_prompts_mc(item, " ", []) == ["Q: 2+2? 4", "Q: 2+2? 5"]


def test_render_schema():
    item = {"context_options": ["Tom fed Ann", "Ann fed Tom"], "continuation": "because she was hungry.", "gold": 1}
    fewshot = [{"context_options": ["The cup fell", "The cat fell"], "continuation": "off the table.", "gold": 0}]
    assert render_prompts_schema(item, " ", fewshot) == [
        "The cup fell off the table.\n\nTom fed Ann because she was hungry.",
        "The cup fell off the table.\n\nAnn fed Tom because she was hungry.",
    ]


def test_render_language_modeling_trims_contexts_and_strips_the_prefix():
    item = {"context": "  The sky is  ", "continuation": "blue"}
    fewshot = [{"context": "Grass is \n", "continuation": "green"}]
    assert render_prompts_lm(item, " ", fewshot) == [
        "Grass is green\n\nThe sky is",
        "Grass is green\n\nThe sky is blue",
    ]
    assert render_prompts_lm(item, "\nAnswer: ", []) == ["The sky is\nAnswer:", "The sky is\nAnswer: blue"]


def test_fewshot_draw_is_nanochats_deterministic_and_excludes_the_item():
    for n, k in [(2, 1), (13, 2), (40, 10), (500, 5)]:
        for idx in range(0, n, max(1, n // 17)):
            others = [i for i in range(n) if i != idx]
            expected = random.Random(1234 + idx).sample(others, k)
            drawn = fewshot_indices(idx, n, k)
            assert drawn == expected == fewshot_indices(idx, n, k)
            assert idx not in drawn and len(set(drawn)) == k
    with pytest.raises(ValueError, match="max_per_task"):
        fewshot_indices(0, 3, 3)


def test_load_shuffles_with_1337_then_crops(bundle_dir):
    tasks = load_core_tasks(bundle_dir, max_per_task=5)
    assert [(t.label, t.task_type, t.num_fewshot, t.continuation_delimiter, t.random_baseline) for t in tasks] == [
        ("mc_task", "multiple_choice", 2, " ", 30.0), ("schema_task", "schema", 1, " ", 50.0),
        ("lm_task", "language_modeling", 3, "\nA: ", 0.0)]
    for task, (_, _, items, *_) in zip(tasks, TASKS):
        shuffled = list(items)
        random.Random(1337).shuffle(shuffled)
        assert task.data == shuffled[:5]
    assert [len(t.data) for t in load_core_tasks(bundle_dir)] == [13, 11, 12]


# ---- scoring ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_len, max_per_task", [(512, -1), (40, 9)])
def test_core_matches_hand_computation(bundle_dir, tokenizer, max_len, max_per_task):
    """Every task type, few-shot prompts, several batches per bucket with padding rows, and (at
    max_len 40) rows left-cropped, which shifts every position the bias table sees."""
    examples = {label: reference_examples(task_type, items, shots, delimiter or " ", tokenizer, max_len, max_per_task)
                for label, task_type, items, shots, delimiter, _ in TASKS}
    model, table, position_bias = make_bigram(tokenizer.get_vocab_size(), 512, examples["lm_task"])
    out = evaluate_core(model, tokenizer, max_per_task=max_per_task, bundle_dir=bundle_dir, max_len=max_len,
                        tokens_per_device=64)
    expected_centered = {}
    for label, task_type, items, shots, delimiter, baseline in TASKS:
        accuracy, margin = reference_accuracy(task_type, examples[label],
                                              lambda row: table[row] + position_bias[:len(row)])
        assert margin > 1e-3, "the fixture must not sit on a float32 tie"
        assert 0 < accuracy < 1, "the fixture must have right and wrong answers"
        # accuracies are counts / n in float64 on both sides (the margin above keeps every count the same)
        assert out["results"][label] == pytest.approx(accuracy, abs=1e-12), label
        expected_centered[label] = (accuracy - 0.01 * baseline) / (1 - 0.01 * baseline)
        assert out["centered_results"][label] == pytest.approx(expected_centered[label], abs=1e-12)
    assert out["core_metric"] == pytest.approx(sum(expected_centered.values()) / 3, abs=1e-12)
    if max_len == 40:  # the test crops what it means to
        assert any(len(r) == 40 for rows, _, _ in examples["lm_task"] for r in rows)


@pytest.mark.parametrize("max_len, midpoint_buckets", [(512, False), (512, True), (40, False)])
def test_rows_and_scores_per_example_match_the_reference(bundle_dir, tokenizer, max_len, midpoint_buckets):
    """Finer than accuracies: the exact token rows and spans of every example, and every row's mean
    continuation loss and exact-prediction flag."""
    examples = {label: reference_examples(task_type, items, shots, delimiter or " ", tokenizer, max_len, -1)
                for label, task_type, items, shots, delimiter, _ in TASKS}
    model, table, position_bias = make_bigram(tokenizer.get_vocab_size(), 512, examples["lm_task"])
    scorer = core_eval.RowScorer(model, tokenizer.get_bos_token_id(), max_len, tokens_per_device=64,
                                 midpoint_buckets=midpoint_buckets)
    for task in load_core_tasks(bundle_dir):
        encoded = core_eval.encode_task(task, tokenizer, max_len)
        assert [(ex.rows, list(zip(ex.starts, ex.ends))) for ex in encoded] == \
            [(rows, spans) for rows, spans, _ in examples[task.label]]
        losses, predicted = scorer.score(encoded)
        for (rows, spans, _), row_losses, row_predicted in zip(examples[task.label], losses, predicted):
            expected = []
            for row, (s, e) in zip(rows, spans):
                logits = table[row[s - 1: e - 1]] + position_bias[s - 1: e - 1]
                logz = np.log(np.exp(logits).sum(axis=1))
                expected.append(np.mean(logz - logits[np.arange(e - s), row[s:e]]))
            # float32 log-sum-exp of logits up to ~20 against float64: a few eps32 of 20 (~5e-6) absolute,
            # which rtol covers for losses of ~1..6 and atol for the near-zero ones of boosted bigrams
            np.testing.assert_allclose(row_losses, expected, rtol=1e-5, atol=1e-5)
            first_logits = table[rows[0][spans[0][0] - 1: spans[0][1] - 1]] + position_bias[spans[0][0] - 1: spans[0][1] - 1]
            assert row_predicted == bool(np.all(first_logits.argmax(axis=1) == rows[0][spans[0][0]: spans[0][1]]))


def test_bucket_lengths():
    lengths = [1, 64, 65, 96, 97, 128, 129, 300, 700, 1000]
    assert [core_eval.bucket_length(n, 1000) for n in lengths] == [64, 64, 128, 128, 128, 128, 256, 512, 1000, 1000]
    assert [core_eval.bucket_length(n, 1000, midpoints=True) for n in lengths] == \
        [64, 64, 96, 96, 128, 128, 192, 384, 768, 1000]


def test_rows_too_long_for_their_continuation_are_an_error(bundle_dir, tokenizer):
    model, _, _ = make_bigram(tokenizer.get_vocab_size(), 64)
    with pytest.raises(ValueError, match="does not fit"):
        evaluate_core(model, tokenizer, bundle_dir=bundle_dir, max_len=3)


def test_core_end_to_end_on_a_tiny_gpt(bundle_dir, tokenizer):
    """A real GPT (every weight random, so no part is a no-op) against the float64 NumPy GPT of nanochat
    scored by nanochat's rules; the second run reuses the first's compiled programs."""
    config = GPTConfig(sequence_len=32, vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=2, n_kv_head=2,
                       n_embd=32, window_pattern="SL")
    model = randomized(config, seed=2)
    core_eval._score_rows.clear_cache()
    first = evaluate_core(model, tokenizer, bundle_dir=bundle_dir, tokens_per_device=256)
    second = evaluate_core(model, tokenizer, bundle_dir=bundle_dir, tokens_per_device=256)
    assert first == second  # the same program on the same rows: bit-exact
    assert set(first["results"]) == {"mc_task", "schema_task", "lm_task"}
    state_dict = to_nanochat_state_dict(model)
    max_len = core_eval.default_max_len(model)
    for label, task_type, items, shots, delimiter, _ in TASKS:
        examples = reference_examples(task_type, items, shots, delimiter or " ", tokenizer, max_len, -1)
        accuracy, margin = reference_accuracy(
            task_type, examples, lambda row: np_forward(state_dict, config, np.asarray([row]))[0])
        # float32 against float64 logits of size ~15 (the soft cap): errors of ~1e-5; a smaller margin
        # could let rounding flip a decision, and the comparison would no longer be exact
        assert margin > 1e-3, (label, margin)
        # accuracies are counts / n in float64 on both sides
        assert first["results"][label] == pytest.approx(accuracy, abs=1e-12), label
    # one compilation per bucket length for the whole run, shared by every task and by the second run
    rows = [len(r) for task in load_core_tasks(bundle_dir)
            for ex in core_eval.encode_task(task, tokenizer, 320) for r in ex.rows]
    buckets = {core_eval.bucket_length(n, 320, midpoints=True) for n in rows}  # the CPU default
    assert core_eval._score_rows._cache_size() == len(buckets) >= 2


# ---- the bundle download ----------------------------------------------------------------------------
def serve_directory(directory: str):
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=directory, **kwargs)

        def do_GET(self):
            requests.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, requests


def test_download_unpacks_once_even_with_concurrent_callers(tmp_path, bundle_dir):
    served = tmp_path / "served"
    served.mkdir()
    with zipfile.ZipFile(served / "eval_bundle.zip", "w") as archive:
        for root, _, files in os.walk(bundle_dir):
            for name in files:
                path = os.path.join(root, name)
                archive.write(path, os.path.join("eval_bundle", os.path.relpath(path, bundle_dir)))
    server, requests = serve_directory(str(served))
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/eval_bundle.zip"
        base = str(tmp_path / "base")
        results = []
        threads = [threading.Thread(target=lambda: results.append(download_eval_bundle(base, url))) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [os.path.join(base, "eval_bundle")] * 3
        assert requests == ["/eval_bundle.zip"]
        assert [t.data for t in load_core_tasks(results[0])] == [t.data for t in load_core_tasks(bundle_dir)]
        assert sorted(os.listdir(base)) == ["eval_bundle", "eval_bundle.lock"]  # no temporary leftovers
    finally:
        server.shutdown()


def test_download_offline_says_what_to_do(tmp_path, monkeypatch):
    sleeps = []
    monkeypatch.setattr(download.time, "sleep", sleeps.append)  # were it retried: the back-off, without the wait
    server, _ = serve_directory(str(tmp_path))
    port = server.server_address[1]
    server.shutdown()
    server.server_close()  # nothing listens on the port now
    with pytest.raises(RuntimeError, match="could not download the CORE eval bundle from .*refused.*unzip it into "
                                           ".*base, so that .*base/eval_bundle/core.yaml exists"):
        download_eval_bundle(str(tmp_path / "base"), f"http://127.0.0.1:{port}/eval_bundle.zip")
    assert sleeps == []  # nothing listens there: a refused connection is not retried
    assert not os.path.exists(tmp_path / "base" / "eval_bundle")


def test_download_without_dns_is_not_retried(tmp_path, monkeypatch):
    """An offline machine's resolver fails (simulated: a test reaches no network); that was retried with back-off
    for 30 s. Now one attempt and the same advice, saying the network is unreachable."""
    sleeps, attempts = [], []
    monkeypatch.setattr(download.time, "sleep", sleeps.append)

    def no_dns(request, timeout):
        attempts.append(request.full_url)
        raise download.urllib.error.URLError(socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"))

    monkeypatch.setattr(download.urllib.request, "urlopen", no_dns)
    with pytest.raises(RuntimeError, match="cannot resolve the host name.*network is unreachable.*unzip it into "):
        download_eval_bundle(str(tmp_path / "base"), "https://bundles.example/eval_bundle.zip")
    assert attempts == ["https://bundles.example/eval_bundle.zip"] and sleeps == []


def test_download_of_something_else_is_refused(tmp_path):
    (tmp_path / "served").mkdir()
    with zipfile.ZipFile(tmp_path / "served" / "eval_bundle.zip", "w") as archive:
        archive.writestr("readme.txt", "not a bundle")
    server, _ = serve_directory(str(tmp_path / "served"))
    try:
        with pytest.raises(RuntimeError, match="not an eval bundle"):
            download_eval_bundle(str(tmp_path / "base"), f"http://127.0.0.1:{server.server_address[1]}/eval_bundle.zip")
    finally:
        server.shutdown()
