"""What a DFlash drafter must be to serve a target (stdlib only): checked where both are first known, so a drafter
that cannot work stops the run before anything is quantized, baked or built.

vLLM's DFlashDraftModel shares the target's embedding and LM head and conditions on the target's hidden states after
the layers `dflash_config.target_layer_ids` name (vLLM taps layer id + 1's input), projected by `fc` from
len(ids) x target_hidden_size; one pass denoises a block of `block_size` positions, the first of them the last
accepted token, so a step drafts at most block_size - 1 tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

DRAFTER_ARCHITECTURE = "DFlashDraftModel"


def read_config(checkpoint: str | Path) -> dict:
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path} is missing: not a checkpoint")
    return json.loads(path.read_text())


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def fit_problems(drafter: dict, target: dict, where: str = "the drafter") -> list[str]:
    """Why `drafter` (its config.json) cannot draft for `target` (the target checkpoint's config.json), each naming
    the field and both values; empty when it can."""
    text = text_config(target)
    flash = drafter.get("dflash_config") or {}
    problems = []
    if DRAFTER_ARCHITECTURE not in drafter.get("architectures", []):
        problems.append(f"{where}: architectures {drafter.get('architectures')} is not [{DRAFTER_ARCHITECTURE!r}]")
    hidden = drafter.get("target_hidden_size", drafter.get("hidden_size"))
    if hidden != text["hidden_size"]:
        problems.append(f"{where}: target_hidden_size {hidden} != the target's hidden_size {text['hidden_size']}")
    layers = flash.get("target_layer_ids") or []
    deepest = text["num_hidden_layers"] - 2  # vLLM taps the input of layer id + 1, which must exist
    if not layers or any(not isinstance(i, int) or i < 0 or i > deepest for i in layers):
        problems.append(
            f"{where}: dflash_config.target_layer_ids {layers} must be ids 0..{deepest} of the target's "
            f"{text['num_hidden_layers']} layers"
        )
    vocab = drafter.get("vocab_size")
    if vocab is not None and vocab != text["vocab_size"]:
        problems.append(
            f"{where}: vocab_size {vocab} != the target's {text['vocab_size']} (it drafts through the target's head)"
        )
    mask = flash.get("mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < text["vocab_size"]:
        problems.append(f"{where}: dflash_config.mask_token_id {mask} is not an id of the target's vocabulary")
    if not isinstance(flash.get("block_size"), int) or flash["block_size"] < 2:
        problems.append(f"{where}: dflash_config.block_size {flash.get('block_size')} must be an integer >= 2")
    return problems


def depth_problems(drafter: dict, k: int, where: str = "speculative.k") -> list[str]:
    """K the drafter's block cannot hold (one position of a block is the last accepted token)."""
    block = (drafter.get("dflash_config") or {}).get("block_size")
    if isinstance(block, int) and k > block - 1:
        return [f"{where}: {k} is above the drafter's block_size - 1 = {block - 1}"]
    return []
