"""The tiny profile's model: tokenizer, synthesis in Qwen3.5-4B's format, its brief training, and its quality
tasks' data and training conversations (tasks.py)."""
