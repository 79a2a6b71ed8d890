"""Serving code baked into the image: `python -m serving` starts vLLM's OpenAI server."""
