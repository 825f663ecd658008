"""Every test runs on the CPU with 8 virtual devices, so multi-device code is tested
without a GPU. Must run before JAX is imported anywhere."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("WANDB_MODE", "disabled")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def builtin_docs() -> list[str]:
    """The built-in corpus (the docstrings of Python's standard library), parsed once per session."""
    from jaxchat import dataset

    return dataset.builtin_documents()


@pytest.fixture(scope="session")
def make_base_dir(builtin_docs):
    """make(path, num_docs=300, chars_per_shard=150_000) fills path as a user's base dir after
    `python -m jaxchat.dataset --builtin` and `python -m scripts.tok_train`: small shards of the first
    num_docs built-in documents (rows groups of 8) and a 512-token tokenizer trained on them."""

    def make(path, num_docs: int = 300, chars_per_shard: int = 150_000):
        from jaxchat import dataset
        from jaxchat.tokenizer import Tokenizer

        documents = builtin_docs[:num_docs]
        dataset.write_shards(lambda: documents, str(path / "base_data"), chars_per_shard=chars_per_shard,
                             docs_per_row_group=8)
        Tokenizer.train_from_iterator(iter(documents), vocab_size=512).save(str(path / "tokenizer"))
        return path

    return make
