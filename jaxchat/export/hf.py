"""Hand a jaxchat model to Hugging Face: a directory that transformers loads, lm-evaluation-harness scores and
the Hub serves.

    DIR/config.json              JaxchatConfig (jaxchat.export.hf_modeling), auto_map to the modeling file
    DIR/modeling_jaxchat.py      jaxchat/export/hf_modeling.py as it is: the exact model of the checkpoint's recipe
    DIR/model.safetensors        nanochat's names and layout (jaxchat.export.nanochat), float32
    DIR/generation_config.json   stops where jaxchat's Engine stops (BOS, <|assistant_end|>)
    DIR/tokenizer.json, tokenizer_config.json   the tokenizer as a fast (Rust) tokenizer: tiktoken's merge
                                 ranks turned into BPE merges by transformers' TikTokenConverter, the split
                                 pattern and the special tokens as jaxchat's; BOS first by default
    DIR/README.md                a model card: what it is and how to load it

transformers' own NanoChatForCausalLM cannot hold either recipe (see README.md, Hugging Face). Before a
file is written, the model is built from the files' contents and its logits compared with jaxchat's on a
text, and the tokenizer's ids with jaxchat's; the files then appear together (StagedFiles).
"""

import os
import shutil
import tempfile

import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from jaxchat.common import get_base_dir
from jaxchat.model.engine import default_stop_tokens
from jaxchat.model.gpt import ROTARY_LENGTH_FACTOR, GPTConfig
from jaxchat.export.nanochat import jaxchat_folders, to_nanochat_state_dict
from jaxchat.export.saved_model import find_model_tag, load_model
from jaxchat.checkpoint.staged_files import StagedFiles, check_writable_dir
from jaxchat.data.tokenizer import BOS, RANKS_FILE, TOKENIZER_SUBDIR, Tokenizer, get_tokenizer

MODELING_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_modeling.py")
MODELING_FILE = "modeling_jaxchat.py"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CARD_FILE = "README.md"
INSTALL_HINT = ("pip install -e '.[hf]' (PyTorch's CPU build first keeps it small: "
                "pip install torch --index-url https://download.pytorch.org/whl/cpu)")
# The text of the export's own check: spaces, digits, punctuation and non-ASCII, as any text the model meets
CHECK_TEXT = ("The export's check: 12 apples, 345 pears and 6789 plums cost $3.50.\n\n    Indented code(x) = y;"
              " café, naïve, 你好 and 🌍 are bytes first.")
# Both models run in float32 on the same weights; what differs is the order of float32 additions (matmuls,
# norms, the rotary table's pow). Measured on the test models: at most ~3e-6 on logits of magnitude up to 15.
# A real difference of architecture (a lambda, the smear, a window, the table's bf16 rounding) moves
# logits by more than 1e-2. The bound sits between the two, with room for deeper models' longer sums.
CHECK_TOLERANCE = 1e-3
CHECK_TAIL = 64  # positions checked beyond the longest short window


def import_hf():
    """(torch, transformers), or an ImportError saying how to install them (an optional extra)."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise ImportError(f"the Hugging Face export needs PyTorch and transformers, not installed: {INSTALL_HINT}") from e
    return torch, transformers


def hf_config_fields(config: GPTConfig, tokenizer: Tokenizer) -> dict:
    """JaxchatConfig's fields for a GPT: every recipe difference spelled out as data."""
    features, bos = config.features, tokenizer.get_bos_token_id()
    return dict(recipe=config.recipe, sequence_len=config.sequence_len, vocab_size=config.vocab_size,
                padded_vocab_size=config.padded_vocab_size, n_layer=config.n_layer, n_head=config.n_head,
                n_kv_head=config.n_kv_head, n_embd=config.n_embd, window_sizes=list(config.window_sizes()),
                value_embed_layers=list(config.value_embed_layers()), smear=features.smear, backout=features.backout,
                qk_scale=features.qk_scale, rotary_base=features.rotary_base,
                rotary_table_bf16=not features.rotary_in_compute_dtype,
                bos_token_id=bos, eos_token_id=bos, pad_token_id=bos)


def hf_model(config: GPTConfig, tokenizer: Tokenizer, state_dict: dict[str, np.ndarray]):
    """The transformers model (jaxchat.export.hf_modeling) of these weights, in float32, for the check."""
    torch, _ = import_hf()
    from jaxchat.export import hf_modeling

    hf_config = hf_modeling.JaxchatConfig(**hf_config_fields(config, tokenizer))
    hf_config.auto_map = {"AutoConfig": f"{MODELING_FILE[:-3]}.JaxchatConfig",
                          "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.JaxchatForCausalLM"}
    hf_config.architectures = ["JaxchatForCausalLM"]
    model = hf_modeling.JaxchatForCausalLM(hf_config).float().eval()
    model.load_state_dict({name: torch.from_numpy(np.require(value, requirements="W")) for name, value in state_dict.items()}, strict=True)
    return model


def hf_tokenizer(tokenizer: Tokenizer, model_max_length: int):
    """jaxchat's tokenizer as a transformers fast tokenizer: the same ids for ordinary text, special tokens in
    the text read as special tokens (as in chat templates), BOS prepended by default (nanochat starts every
    document with it; add_special_tokens=False leaves it out)."""
    _, transformers = import_hf()
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with tempfile.TemporaryDirectory() as scratch:
        tokenizer.save(scratch)  # tokenizer.tiktoken is tiktoken's rank format, what the converter reads
        converted = TikTokenConverter(vocab_file=os.path.join(scratch, RANKS_FILE), pattern=tokenizer.pattern,
                                      extra_special_tokens=list(tokenizer.special_tokens)).converted()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=converted, bos_token=BOS, eos_token=BOS,
                                                pad_token=BOS, add_bos_token=True, model_max_length=model_max_length)


def check_length(config: GPTConfig) -> int:
    """Tokens the check runs: past the longest window shorter than the sequence, so that every layer's window
    cuts in (not the whole sequence: a d32's CPU forward of 2048 tokens takes minutes)."""
    windows = [w for w in config.window_sizes() if w < config.sequence_len]
    return min(config.sequence_len, max(windows, default=0) + CHECK_TAIL)


def check_export(model, hf, tokenizer: Tokenizer, hf_tok) -> float:
    """ValueError unless the fast tokenizer gives jaxchat's ids on CHECK_TEXT and the transformers model's
    logits equal jaxchat's on it (repeated to check_length) within CHECK_TOLERANCE; returns the largest
    logit difference."""
    torch, _ = import_hf()
    ids = tokenizer.encode(CHECK_TEXT, prepend=tokenizer.get_bos_token_id())
    if hf_tok(CHECK_TEXT)["input_ids"] != ids:
        raise ValueError("the fast tokenizer's ids differ from jaxchat's on the check's text: not exported")
    length = check_length(model.config)
    ids = (ids * (length // len(ids) + 1))[:length]
    expected = np.asarray(model(jnp.asarray([ids])), np.float64)
    with torch.no_grad():
        got = hf(torch.tensor([ids])).logits.double().numpy()
    difference = float(np.abs(got - expected).max())
    if not difference <= CHECK_TOLERANCE:
        raise ValueError(f"the transformers model's logits differ from jaxchat's by {difference:.3g} "
                         f"(more than {CHECK_TOLERANCE}) on the check's text: not exported")
    return difference


def model_card(meta: dict, model_tag: str) -> str:
    config = meta["model_config"]
    lines = [f"# jaxchat {model_tag}, step {meta['step']}", "",
             f"A base model pretrained with jaxchat (nanochat's recipe {config['recipe']} in JAX): "
             f"{config['n_layer']} layers, width {config['n_embd']}, {config['vocab_size']} tokens, "
             f"trained on sequences of {config['sequence_len']}."]
    if meta.get("val_bpb") is not None:
        lines.append(f"Validation bits per byte: {meta['val_bpb']:.4f}.")
    lines += ["", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)",
              "tokenizer = AutoTokenizer.from_pretrained(PATH, trust_remote_code=True)  # BOS first, as in training",
              "ids = tokenizer('The capital of France is', return_tensors='pt')",
              "print(tokenizer.decode(model.generate(**ids, max_new_tokens=16, do_sample=False)[0]))", "```", ""]
    return "\n".join(lines)


def export_to_hf(output_dir: str, model_tag: str | None = None, step: int | None = None,
                 base_dir: str | None = None, overwrite: bool = False) -> tuple[list[str], float]:
    """Writes the Hugging Face directory of a checkpoint; returns (files written, the check's largest logit
    difference). A file of the export that is there already is refused unless overwrite, and the base dir's
    own folders always (StagedFiles); everything is checked before a file is written, and the files appear
    together."""
    import_hf()
    base_dir = base_dir or get_base_dir()
    tokenizer = get_tokenizer(os.path.join(base_dir, TOKENIZER_SUBDIR))
    model_tag = model_tag or find_model_tag(base_dir)
    # float32 and XLA attention wherever this runs, so that the check compares float32 with float32
    model, meta = load_model(model_tag, step, base_dir, tokenizer=tokenizer, dtype=jnp.float32,
                             attention_implementation="xla")
    hf_tok = hf_tokenizer(tokenizer, ROTARY_LENGTH_FACTOR * model.config.sequence_len)  # what the model reaches
    staged = StagedFiles(overwrite, keep_out=jaxchat_folders(base_dir))
    with tempfile.TemporaryDirectory() as scratch:
        hf_tok.save_pretrained(scratch)  # transformers' own files for its own loader
        copies = {name: os.path.join(scratch, name) for name in sorted(os.listdir(scratch))}
        copies[MODELING_FILE] = MODELING_SOURCE
        names = [*copies, CONFIG_FILE, GENERATION_CONFIG_FILE, MODEL_CARD_FILE, WEIGHTS_FILE]
        written = [os.path.join(output_dir, name) for name in names]
        staged.check(written)
        check_writable_dir(output_dir)
        state_dict = to_nanochat_state_dict(model)
        hf = hf_model(model.config, tokenizer, state_dict)
        difference = check_export(model, hf, tokenizer, hf_tok)
        hf.generation_config.update(bos_token_id=tokenizer.get_bos_token_id(), pad_token_id=tokenizer.get_bos_token_id(),
                                    eos_token_id=default_stop_tokens(tokenizer))
        texts = {CONFIG_FILE: hf.config.to_json_string(), GENERATION_CONFIG_FILE: hf.generation_config.to_json_string(),
                 MODEL_CARD_FILE: model_card(meta, model_tag)}
        with staged:
            for name, source in copies.items():
                shutil.copyfile(source, staged.path(os.path.join(output_dir, name)))
            for name, text in texts.items():
                with open(staged.path(os.path.join(output_dir, name)), "w", encoding="utf-8") as f:
                    f.write(text)
            safetensors.numpy.save_file(state_dict, staged.path(os.path.join(output_dir, WEIGHTS_FILE)),
                                        metadata={"format": "pt"})
    return written, difference


def upload_operations(files: list[str]) -> list:
    """One addition per file the export wrote, under its own name: nothing else in the directory (a .env,
    notes, an older export's leftovers) goes up."""
    from huggingface_hub import CommitOperationAdd

    return [CommitOperationAdd(path_in_repo=os.path.basename(path), path_or_fileobj=path) for path in files]


def push_to_hub(files: list[str], repo_id: str, private: bool = False) -> str:
    """Uploads the files of an export to a Hub model repository, in one commit; creates the repository if
    needed, public unless private (huggingface-cli upload's default). An existing public repository is
    refused when private is asked for: create_repo leaves an existing repository's visibility as it is.
    Returns its URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    url = api.create_repo(repo_id, private=private, exist_ok=True)
    if private and not api.repo_info(repo_id).private:
        raise ValueError(f"{repo_id} exists already and is public: --private does not change it; make it private "
                         "on the Hub first, or push to another repository")
    api.create_commit(repo_id, operations=upload_operations(files), commit_message="jaxchat export")
    return str(url)
