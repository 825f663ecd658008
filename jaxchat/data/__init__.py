"""Text to token batches: parquet shards (downloaded, or made from local text), the tokenizer, the loader."""
