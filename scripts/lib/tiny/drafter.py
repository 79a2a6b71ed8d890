"""A DFlash drafter (vLLM's `DFlashDraftModel`) with random weights, for a given target: the tiny profile's
drafter and the GPU proof's stand-in for z-lab/Qwen3.5-4B-DFlash.

A DFlash drafter is a few Qwen3 decoder layers that denoise a whole block of masked positions at once, conditioned
on hidden states the target exposes at `dflash_config.target_layer_ids` (projected by `fc` from
len(target_layer_ids) x hidden to hidden). It ships no embedding and no LM head: vLLM shares the target's. The layout
below is what vLLM 0.26 loaded and served on an H200 (the GPU proof's dflash records, records/gpu-proof/h200/).
"""

from __future__ import annotations

import json
from pathlib import Path

# z-lab/Qwen3.5-4B-DFlash@9a1996ccf887b79ab3af4fcbf8c1d1f4b5658bcf's shapes as public write-ups of that commit give
# them (69 tensors, 634,425,856 bf16 parameters: fc 20480 -> 2560 from eight tapped layers, six layers of 32/8 heads
# of 128 and an MLP of 9216). That checkpoint also sets use_sliding_window (five sliding layers, the last one full),
# which a random stand-in leaves out: every layer here attends to the whole context, the costlier case.
QWEN35_4B_DRAFTER = {
    "num_hidden_layers": 6,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9216,
    "target_layer_ids": [1, 5, 9, 13, 17, 21, 25, 29],
    "block_size": 16,
}
WEIGHTS_FILE = "model.safetensors"


def drafter_config(target_text: dict, dims: dict, mask_token_id: int) -> dict:
    """config.json of a drafter for a target whose text config is `target_text`; its hidden size is the target's (it
    embeds and reads out through the target's own embedding and head)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target_text["hidden_size"],
        "num_hidden_layers": dims["num_hidden_layers"],
        "num_attention_heads": dims["num_attention_heads"],
        "num_key_value_heads": dims["num_key_value_heads"],
        "head_dim": dims["head_dim"],
        "intermediate_size": dims["intermediate_size"],
        "hidden_act": "silu",
        "rms_norm_eps": target_text.get("rms_norm_eps", 1e-6),
        "rope_theta": target_text.get("rope_parameters", {}).get("rope_theta", 10000000),
        "max_position_embeddings": target_text["max_position_embeddings"],
        "vocab_size": target_text["vocab_size"],
        "target_hidden_size": target_text["hidden_size"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "dflash_config": {
            "target_layer_ids": list(dims["target_layer_ids"]),
            "mask_token_id": mask_token_id,
            "block_size": dims["block_size"],
        },
    }


def tensor_shapes(config: dict) -> dict[str, list[int]]:
    hidden, heads, kv, head_dim = (
        config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    shapes = {
        "fc.weight": [hidden, len(config["dflash_config"]["target_layer_ids"]) * config["target_hidden_size"]],
        "hidden_norm.weight": [hidden],
        "norm.weight": [hidden],
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"layers.{layer}."
        shapes |= {
            prefix + "self_attn.q_proj.weight": [heads * head_dim, hidden],
            prefix + "self_attn.k_proj.weight": [kv * head_dim, hidden],
            prefix + "self_attn.v_proj.weight": [kv * head_dim, hidden],
            prefix + "self_attn.o_proj.weight": [hidden, heads * head_dim],
            prefix + "self_attn.q_norm.weight": [head_dim],
            prefix + "self_attn.k_norm.weight": [head_dim],
            prefix + "mlp.gate_proj.weight": [config["intermediate_size"], hidden],
            prefix + "mlp.up_proj.weight": [config["intermediate_size"], hidden],
            prefix + "mlp.down_proj.weight": [hidden, config["intermediate_size"]],
            prefix + "input_layernorm.weight": [hidden],
            prefix + "post_attention_layernorm.weight": [hidden],
        }
    return shapes


def build_random_drafter(out_dir: str | Path, target_dir: str | Path, dims: dict, seed: int = 0) -> dict:
    """A drafter for the checkpoint in `target_dir`, seeded random bf16 weights (norms at 1) under the current
    torch device; returns its config. Its mask token is the target's pad token (an id inside the vocabulary that
    no prompt uses)."""
    import torch
    from safetensors.torch import save_file

    target = json.loads((Path(target_dir) / "config.json").read_text())
    text = target.get("text_config", target)
    generation = Path(target_dir) / "generation_config.json"
    pad = json.loads(generation.read_text()).get("pad_token_id") if generation.exists() else None
    config = drafter_config(text, dims, pad if isinstance(pad, int) else text["vocab_size"] - 1)
    generator = torch.Generator(device=torch.get_default_device()).manual_seed(seed)
    tensors = {}
    for name, shape in tensor_shapes(config).items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in out.iterdir():  # readable by a container's non-root server user
        path.chmod(0o644)
    return config
