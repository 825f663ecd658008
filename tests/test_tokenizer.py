"""Tokenizer: training, byte-exact round trips on awkward Unicode, agreement with a plain-Python BPE,
special tokens, pickle-free save/load, and token_bytes computed independently from the rank file."""

import base64
import json
import random

import numpy as np
import pytest
import regex

from jaxchat import storage
from jaxchat.data.tokenizer import (CONFIG_FILE, RANKS_FILE, SPECIAL_TOKENS, SPLIT_PATTERN, TOKEN_BYTES_FILE,
                               Tokenizer, TokenizerError, get_token_bytes, get_tokenizer)

VOCAB_SIZE = 512

WORDS = ("the of and to in is was for that with on as by at from his her it an were which are this be "
         "river mountain lighthouse keeper storm harbour winter morning birds numbers 2024 1999 42 3.14 "
         "don't it's we're you'll they've I'm").split()
MULTILINGUAL = [
    "你好世界，今天天气很好。我们去公园散步吧。",
    "東京は日本の首都です。灯台守は日誌をつけていた。",
    "등대지기는 바람의 방향을 일지에 적었다.",
    "Смотритель маяка вёл журнал наблюдений.",
    "Der Leuchtturmwärter führte ein Logbuch; l'état de la mer était calme.",
    "emoji 🌍🔥🎉 and families 👩‍👩‍👧‍👦 and flags 🇺🇳🇯🇵",
    "combining marks: e\u0301 a\u0308 n\u0303 Z\u0324\u0354\u0367\u0311\u0313",
]

EDGE_CASES = [
    "",
    " ",
    "\n\n\r\n\t",
    "e\u0301\u0302\u0303 stacked combining marks",
    "Z\u0324\u0354\u0367\u0311\u0313a\u0308\u0356\u032d\u0308\u0307l\u036e\u0312\u036b",
    "👩‍👩‍👧‍👦 zero-width joiner family, 👍🏽 skin tone, 🇺🇳 flag",
    "你好世界 日本語のテキスト 한국어 텍스트",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 astral plane 𝕏 and \U0010ffff the last code point",
    "\u200b\u200c\u200d\ufeff invisible characters",
    "مرحبا بالعالم right-to-left",
    "\x00\x01\x7f control bytes",
    "<|bos|> looks special but is text",
    "numbers 1234567890 3.14159 -0.5e-10",
    "    indented code\n\tdef f(x): return x ** 2",
]


def make_corpus(num_sentences: int = 1500) -> list[str]:
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 20))) + "." for _ in range(num_sentences)]
    return docs + MULTILINGUAL * 40


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train_from_iterator(iter(make_corpus()), VOCAB_SIZE)


def reference_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """Plain-Python byte-level BPE: split with the pattern, then in each chunk repeatedly merge the adjacent
    pair whose concatenation has the lowest rank (leftmost on ties) until no pair is in the table."""
    ids = []
    for chunk in regex.findall(SPLIT_PATTERN, text):
        parts = [bytes([b]) for b in chunk.encode("utf-8")]
        while len(parts) > 1:
            pair_ranks = [ranks.get(parts[i] + parts[i + 1], float("inf")) for i in range(len(parts) - 1)]
            best = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)
            if pair_ranks[best] == float("inf"):
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        ids += [ranks[part] for part in parts]
    return ids


def read_rank_file(path) -> dict[int, bytes]:
    """The rank file parsed here, independently of the code under test: rank -> token bytes."""
    by_rank = {}
    for line in open(path, "rb").read().splitlines():
        token, rank = line.split(b" ")
        by_rank[int(rank)] = base64.b64decode(token)
    return by_rank


def test_training_gives_requested_vocab_with_bytes_merges_then_specials(tokenizer):
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    ranks = tokenizer.mergeable_ranks
    num_ranks = VOCAB_SIZE - len(SPECIAL_TOKENS)
    assert len(ranks) == num_ranks
    by_rank = {rank: token for token, rank in ranks.items()}
    assert [by_rank[b] for b in range(256)] == [bytes([b]) for b in range(256)]
    # every merged token is the concatenation of two tokens that existed before it
    for rank in range(256, num_ranks):
        token = by_rank[rank]
        assert any(ranks.get(token[:k], num_ranks) < rank and ranks.get(token[k:], num_ranks) < rank
                   for k in range(1, len(token))), token
    assert tokenizer.get_special_tokens() == SPECIAL_TOKENS
    assert [tokenizer.encode_special(name) for name in SPECIAL_TOKENS] == list(range(num_ranks, VOCAB_SIZE))
    assert tokenizer.get_bos_token_id() == num_ranks


def test_vocab_size_must_leave_room_for_bytes_and_specials():
    with pytest.raises(ValueError, match="at least 265"):
        Tokenizer.train_from_iterator(iter(["some text"]), 264)


def test_encoding_matches_plain_python_bpe(tokenizer):
    texts = make_corpus(50)[:50] + MULTILINGUAL + EDGE_CASES
    for text in texts:
        assert tokenizer.encode(text) == reference_encode(text, tokenizer.mergeable_ranks), text


@pytest.mark.parametrize("text", EDGE_CASES)
def test_round_trip_is_exact_on_unicode_edge_cases(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(np.array(ids, dtype=np.int32)) == text
    assert all(0 <= i < len(tokenizer.mergeable_ranks) for i in ids)  # text never yields a special token


def test_tokens_that_are_invalid_utf8_alone_still_round_trip(tokenizer):
    by_rank = {rank: token for token, rank in tokenizer.mergeable_ranks.items()}

    def valid_alone(token_id):
        try:
            by_rank[token_id].decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    text = "你好世界 🌍🔥 e\u0301 東京"
    ids = tokenizer.encode(text)
    invalid = [i for i in ids if not valid_alone(i)]
    assert invalid, "the sample should contain tokens that are partial UTF-8 sequences"
    assert tokenizer.decode(ids) == text
    assert all("\ufffd" in tokenizer.id_to_token(i) for i in invalid)
    # a multi-byte character cut into single-byte tokens still decodes exactly once reassembled
    assert tokenizer.decode(list("🌍".encode("utf-8"))) == "🌍"


def test_batch_encoding_and_special_tokens_by_name_or_id(tokenizer):
    texts = MULTILINGUAL + EDGE_CASES
    singles = [reference_encode(t, tokenizer.mergeable_ranks) for t in texts]
    assert tokenizer.encode(texts, num_threads=1) == singles
    assert tokenizer.encode(texts, num_threads=4) == singles
    assert tokenizer(texts) == singles
    bos = tokenizer.get_bos_token_id()
    end = tokenizer.encode_special("<|assistant_end|>")
    assert tokenizer.encode(texts, prepend="<|bos|>", append=end) == [[bos] + s + [end] for s in singles]
    assert tokenizer.encode(texts[0], prepend=np.int32(bos), append="<|assistant_end|>") == [bos] + singles[0] + [end]
    assert tokenizer.encode([]) == []
    assert "<|bos|>" in tokenizer.decode([bos]) and tokenizer.id_to_token(end) == "<|assistant_end|>"
    with pytest.raises(ValueError, match="unknown special token"):
        tokenizer.encode("x", prepend="<|nope|>")
    with pytest.raises(TypeError, match="str or a list of str"):
        tokenizer.encode(("a", "b"))


def test_save_load_round_trip_without_pickle(tokenizer, tmp_path):
    tokenizer.save(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CONFIG_FILE, RANKS_FILE, TOKEN_BYTES_FILE])
    # the files are plain text / plain arrays, readable without our code
    by_rank = read_rank_file(tmp_path / RANKS_FILE)
    assert {token: rank for rank, token in by_rank.items()} == tokenizer.mergeable_ranks
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config["pattern"] == SPLIT_PATTERN
    assert config["special_tokens"] == {name: len(by_rank) + i for i, name in enumerate(SPECIAL_TOKENS)}

    loaded = get_tokenizer(str(tmp_path))
    assert loaded.mergeable_ranks == tokenizer.mergeable_ranks
    assert loaded.special_tokens == tokenizer.special_tokens
    assert loaded.get_vocab_size() == tokenizer.get_vocab_size()
    texts = MULTILINGUAL + EDGE_CASES
    assert loaded.encode(texts, prepend="<|bos|>") == tokenizer.encode(texts, prepend="<|bos|>")


def test_retraining_into_the_same_directory_loads_the_new_tokenizer(tmp_path):
    # tiktoken's own rank-file loader caches by path; ours must not
    first = Tokenizer.train_from_iterator(iter(make_corpus()), 300)
    first.save(str(tmp_path))
    assert get_tokenizer(str(tmp_path)).get_vocab_size() == 300
    second = Tokenizer.train_from_iterator(iter(make_corpus()), 400)
    second.save(str(tmp_path))
    assert get_tokenizer(str(tmp_path)).mergeable_ranks == second.mergeable_ranks


def test_token_bytes_count_raw_bytes_even_for_partial_utf8_tokens(tokenizer, tmp_path):
    tokenizer.save(str(tmp_path))
    token_bytes = get_token_bytes(str(tmp_path))
    assert token_bytes.dtype == np.int32 and token_bytes.shape == (VOCAB_SIZE,)
    by_rank = read_rank_file(tmp_path / RANKS_FILE)
    expected = np.array([len(by_rank[r]) for r in range(len(by_rank))] + [0] * len(SPECIAL_TOKENS))
    np.testing.assert_array_equal(token_bytes, expected)
    # where a token is not valid UTF-8 on its own, decoding it would miscount (U+FFFD is 3 bytes)
    decoded_lengths = np.array([len(tokenizer.id_to_token(i).encode("utf-8")) for i in range(len(by_rank))])
    differs = np.flatnonzero(decoded_lengths != expected[:len(by_rank)])
    assert len(differs) > 128  # all lone bytes 0x80-0xff, plus merged partial characters
    assert any(len(by_rank[i]) > 1 for i in differs)


def test_missing_tokenizer_says_which_command_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="python -m scripts.tok_train"):
        get_tokenizer()
    with pytest.raises(FileNotFoundError, match="python -m scripts.tok_train"):
        get_token_bytes()


def test_default_location_is_under_the_base_dir(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(tmp_path))
    tokenizer.save(str(tmp_path / "tokenizer"))
    assert get_tokenizer().mergeable_ranks == tokenizer.mergeable_ranks
    np.testing.assert_array_equal(get_token_bytes(), tokenizer.token_bytes())


def test_a_tokenizer_in_a_bucket_loads_as_from_a_disk_and_a_missing_one_is_named(tokenizer, tmp_path, gcs,
                                                                                    monkeypatch):
    monkeypatch.setenv("JAXCHAT_BASE_DIR", gcs)
    tokenizer.save(f"{gcs}/tokenizer")  # as scripts.tok_train saves it into a gs:// base dir
    tokenizer.save(str(tmp_path))
    for name in (CONFIG_FILE, RANKS_FILE, TOKEN_BYTES_FILE):  # the same bytes as on a disk
        assert storage.read_bytes(f"{gcs}/tokenizer/{name}") == (tmp_path / name).read_bytes()
    assert get_tokenizer().mergeable_ranks == tokenizer.mergeable_ranks
    np.testing.assert_array_equal(get_token_bytes(), tokenizer.token_bytes())
    with pytest.raises(FileNotFoundError, match=f"no tokenizer at {gcs}/elsewhere .*python -m scripts.tok_train"):
        get_tokenizer(f"{gcs}/elsewhere")


def test_loading_refuses_pickles_and_malformed_files(tokenizer, tmp_path):
    tokenizer.save(str(tmp_path))
    np.save(tmp_path / TOKEN_BYTES_FILE, np.array([object()]), allow_pickle=True)
    with pytest.raises(ValueError, match="allow_pickle"):
        get_token_bytes(str(tmp_path))
    lines = (tmp_path / RANKS_FILE).read_bytes().splitlines(keepends=True)
    (tmp_path / RANKS_FILE).write_bytes(b"".join(lines[:3]) + b"not-base64!! x\n" + b"".join(lines[3:]))
    with pytest.raises(ValueError, match=f"{RANKS_FILE} cannot be read \\(line 4 is not"):
        get_tokenizer(str(tmp_path))
    (tmp_path / RANKS_FILE).write_bytes(b"".join(lines[:3] + lines[4:]))  # a gap in the ranks
    with pytest.raises(ValueError, match="0..n-1"):
        get_tokenizer(str(tmp_path))


TO_DO = "restore it from a copy of this tokenizer, or train a new one with `python -m scripts.tok_train`"


def cut_short(path, keep: float) -> None:
    path.write_bytes(path.read_bytes()[:int(keep * path.stat().st_size)])


@pytest.mark.parametrize("name", [CONFIG_FILE, RANKS_FILE, TOKEN_BYTES_FILE])
@pytest.mark.parametrize("keep", [0.0, 0.5])
def test_a_file_cut_short_is_one_line_naming_it_and_what_to_do(tokenizer, tmp_path, name, keep):
    tokenizer.save(str(tmp_path))
    cut_short(tmp_path / name, keep)
    with pytest.raises(TokenizerError) as info:
        get_tokenizer(str(tmp_path)), get_token_bytes(str(tmp_path))
    message = str(info.value)
    assert message.startswith(f"{tmp_path / name} cannot be read (") and TO_DO in message and "\n" not in message


def test_a_ranks_file_cut_at_a_line_end_is_told_apart_by_the_special_tokens(tokenizer, tmp_path):
    """Whole lines, ranks 0..k-1: a valid smaller vocabulary, but tokenizer.json numbers the special tokens after
    all of them."""
    tokenizer.save(str(tmp_path))
    lines = (tmp_path / RANKS_FILE).read_bytes().splitlines(keepends=True)
    (tmp_path / RANKS_FILE).write_bytes(b"".join(lines[:300]))
    with pytest.raises(TokenizerError, match=f"{RANKS_FILE} cannot be read \\(300 merge ranks, but .*{CONFIG_FILE} "
                                             "numbers its special tokens after another count\\)"):
        get_tokenizer(str(tmp_path))


@pytest.mark.parametrize("script", ["train", "sample"])
def test_the_scripts_stop_on_a_cut_tokenizer_with_that_line(tokenizer, tmp_path, monkeypatch, capsys, script):
    """scripts.train (before any data or compute) and the scripts that load a saved model (scripts.sample here;
    base_eval and base_loss share its loader): status 2 and the one line, no traceback."""
    from scripts import sample, train

    tokenizer.save(str(tmp_path / "tokenizer"))
    cut_short(tmp_path / "tokenizer" / CONFIG_FILE, 0.5)
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(tmp_path))
    argv = {"train": ["--depth=2", "--max-seq-len=64", "--device-batch-size=1", "--total-batch-size=64",
                      "--num-devices=1", "--device-type=cpu", "--core-metric-every=-1"],
            "sample": ["-p", "x", "--device-type=cpu"]}[script]
    with pytest.raises(SystemExit) as stopped:
        {"train": train, "sample": sample}[script].main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'tokenizer' / CONFIG_FILE} cannot be read (JSONDecodeError: ") and \
        TO_DO in err and err.count("\n") == 1, err
