"""What a batch-1 decode step reads from memory, from a checkpoint's safetensors headers (stdlib only: the quantize
stage, compare and the GPU proof share it).

At batch 1 a decode step reads every decoder weight and the whole LM head once; the embedding gives one row. With
MTP depth K a step also runs the MTP layer K times, each with the shared head. Bytes over bandwidth is the step's
floor: the roofline the measured inter-token latency is read against.
"""

from __future__ import annotations

from pathlib import Path

from lib.safetensors import model_part, read_header, tensor_bytes

A10G_GBPS = 600.0  # the contract's GPU (NVIDIA A10G, 600 GB/s): the bound the competition's latency is bought against
PARTS = ("decoder", "lm_head", "embed_tokens", "mtp", "vision")


def part_bytes(model_dir: str | Path) -> dict[str, int]:
    """Tensor bytes of a checkpoint by part (decoder, lm_head, embed_tokens, mtp, vision)."""
    parts = dict.fromkeys(PARTS, 0)
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        for tensor, info in read_header(shard).items():
            parts[model_part(tensor)] += tensor_bytes(info)
    return parts


def step_total(step: dict, draft_passes: int, drafter_bytes: int = 0) -> int:
    """A step's bytes (step_bytes' decoder, lm_head, mtp_per_draft) with `draft_passes` MTP passes, or with a drafter
    model of `drafter_bytes` (DFlash: one pass through the drafter, then the target's head once more)."""
    drafting = drafter_bytes + step["lm_head"] if drafter_bytes else 0
    return step["decoder"] + step["lm_head"] + draft_passes * step["mtp_per_draft"] + drafting


def step_bytes(parts: dict[str, int], draft_passes: int = 0) -> dict:
    """Bytes one decode step reads: decoder + head, plus draft_passes x (MTP layer + head). A tied head (no
    lm_head tensor, as Qwen3.5-4B ships) is the embedding matrix, read whole by the head's GEMM."""
    tied = parts["lm_head"] == 0
    head = parts["embed_tokens"] if tied else parts["lm_head"]
    step = {
        "decoder": parts["decoder"],
        "lm_head": head,
        "tied_head": tied,
        "mtp_per_draft": parts["mtp"] + head,
        "draft_passes": draft_passes,
    }
    return {**step, "total": step_total(step, draft_passes)}


def draft_passes(speculative: dict) -> int:
    """Passes through the MTP layer (and the head) a decode step makes: K with MTP; copy-style drafts (ngram,
    suffix) read no weights."""
    return speculative["k"] if speculative["method"] == "mtp" else 0


def bound_ms(total_bytes: int, gbps: float = A10G_GBPS) -> float:
    """The step's floor in milliseconds at `gbps` GB/s."""
    return total_bytes / (gbps * 1e9) * 1e3
