"""safetensors headers read without torch (the format is 8 bytes of little-endian length, then JSON)."""

import json
from pathlib import Path


def read_header(path: str | Path) -> dict[str, dict]:
    """Tensor name -> {dtype, shape, data_offsets} of one file, without its __metadata__."""
    with open(path, "rb") as handle:
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    header.pop("__metadata__", None)
    return header


def tensor_bytes(info: dict) -> int:
    begin, end = info["data_offsets"]
    return end - begin


def checkpoint_header(directory: str | Path) -> dict[str, dict]:
    """Tensor name -> {dtype, shape, bytes}, over every shard of a checkpoint folder (no tensor is read)."""
    return {
        name: {"dtype": info["dtype"], "shape": info["shape"], "bytes": tensor_bytes(info)}
        for shard in sorted(Path(directory).glob("*.safetensors"))
        for name, info in read_header(shard).items()
    }


def model_part(tensor: str) -> str:
    """Which part of a Qwen3.5 checkpoint a tensor belongs to: decoder, lm_head, embed_tokens, mtp or vision."""
    if tensor.startswith("mtp."):
        return "mtp"
    if "visual" in tensor:
        return "vision"
    if "embed_tokens" in tensor:
        return "embed_tokens"
    if tensor.startswith("lm_head"):
        return "lm_head"
    return "decoder"
