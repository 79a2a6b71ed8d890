"""The tiny profile's model: tokenizer, synthesis in Qwen3.5-4B's format, and its brief training."""
