"""A tiny, seeded, random-weight model in the exact on-disk format of Qwen/Qwen3.5-4B.

It lets the tiny profile run every real stage (quantize, serve, evaluate) on a CPU machine: the
same architecture class, config keys, tensor names, special tokens, chat template and processor
files as the real checkpoint, only small. Heavy imports stay inside functions: this module is
also imported by the main interpreter (tests of the chat template, the config builder).
"""

import json
from pathlib import Path

from lib.safetensors import read_header, tensor_bytes
from lib.stage import write_json
from lib.tiny.tokenizer import SPECIAL_TOKENS, train_tokenizer
from lib.tiny.training import train_model

# Qwen3.5-4B's shape, shrunk. Linear-attention head dims 64, the smallest vLLM's CPU GDN kernel takes
# ("Unexpected head dim size, 32"); at 128 their chunked delta rule took a third to a half of a training step.
# Every Linear a quantizer may touch has both dims multiples of 32, except
# in_proj_a/in_proj_b whose output width is linear_num_value_heads (kept 16-bit, as in the real
# recipes, where it is 32 wide).
TINY_DIMS = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 32768,
    "mtp_num_hidden_layers": 1,
    # Qwen3.5-4B ties its LM head to the input embedding (model card: "LM Output: 248320 (Tied to token
    # embedding)"; no lm_head.weight): a recipe that quantizes the head must untie it first.
    "tie_word_embeddings": True,
    "vision_depth": 1,
    "vision_hidden_size": 64,
    "vision_intermediate_size": 128,
    "vision_num_heads": 2,
}

IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
VIDEO_PROCESSOR = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}

MTP_FILE = "model-mtp.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def tiny_config(token_ids: dict[str, int], vocab_size: int, **dims) -> dict:
    """config.json of the tiny model (Qwen3.5-4B's keys and layout; sizes from TINY_DIMS)."""
    d = {**TINY_DIMS, **dims}
    assert len(d["layer_types"]) == d["num_hidden_layers"]
    # mrope sections split the rotary half-dim (head_dim * 0.25 / 2) over t/h/w as Qwen does.
    half = int(d["head_dim"] * 0.25) // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]
    text = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": None,
        "dtype": "bfloat16",
        "eos_token_id": token_ids["<|endoftext|>"],
        "full_attention_interval": 4,
        "head_dim": d["head_dim"],
        "hidden_act": "silu",
        "hidden_size": d["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": d["intermediate_size"],
        "layer_types": list(d["layer_types"]),
        "linear_conv_kernel_dim": d["linear_conv_kernel_dim"],
        "linear_key_head_dim": d["linear_key_head_dim"],
        "linear_num_key_heads": d["linear_num_key_heads"],
        "linear_num_value_heads": d["linear_num_value_heads"],
        "linear_value_head_dim": d["linear_value_head_dim"],
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": d["max_position_embeddings"],
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": d["mtp_num_hidden_layers"],
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": d["num_attention_heads"],
        "num_hidden_layers": d["num_hidden_layers"],
        "num_key_value_heads": d["num_key_value_heads"],
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": section,
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "tie_word_embeddings": d["tie_word_embeddings"],
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    vision = {
        "deepstack_visual_indexes": [],
        "depth": d["vision_depth"],
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": d["vision_hidden_size"],
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": d["vision_intermediate_size"],
        "model_type": "qwen3_5",
        "num_heads": d["vision_num_heads"],
        "num_position_embeddings": 2304,
        "out_hidden_size": d["hidden_size"],
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "image_token_id": token_ids["<|image_pad|>"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": d["tie_word_embeddings"],
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_config": vision,
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
    }


def _mtp_tensors(text: dict, seed: int) -> dict:
    """The MTP layer under the names vLLM's Qwen3_5MultiTokenPredictor loads (mtp.* -> model.*):
    fc over [embedding; hidden], its two pre-norms, one full-attention decoder layer, a final norm.
    Norms are zero (Qwen3.5 norms scale by 1 + weight), Linears N(0, initializer_range)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)  # its own stream: independent of the model's init
    h, hd, std = text["hidden_size"], text["head_dim"], text["initializer_range"]
    q, kv, ff = text["num_attention_heads"] * hd, text["num_key_value_heads"] * hd, text["intermediate_size"]
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.layers.0.input_layernorm.weight": (h,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * q, h),  # query and output gate (attn_output_gate)
        "mtp.layers.0.self_attn.k_proj.weight": (kv, h),
        "mtp.layers.0.self_attn.v_proj.weight": (kv, h),
        "mtp.layers.0.self_attn.o_proj.weight": (h, q),
        "mtp.layers.0.self_attn.q_norm.weight": (hd,),
        "mtp.layers.0.self_attn.k_norm.weight": (hd,),
        "mtp.layers.0.post_attention_layernorm.weight": (h,),
        "mtp.layers.0.mlp.gate_proj.weight": (ff, h),
        "mtp.layers.0.mlp.up_proj.weight": (ff, h),
        "mtp.layers.0.mlp.down_proj.weight": (h, ff),
        "mtp.norm.weight": (h,),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
    }
    assert text["mtp_num_hidden_layers"] == 1, "only one MTP layer is generated"
    # on the CPU whatever the default device (the full-size build runs under torch.device("cuda")): the
    # generator is a CPU one, and the bytes stay the same wherever the model itself is made
    return {
        name: (
            torch.zeros(shape, device="cpu")
            if len(shape) == 1
            else torch.randn(shape, generator=gen, device="cpu") * std
        )
        .to(torch.bfloat16)
        .contiguous()
        for name, shape in sorted(shapes.items())
    }


def build_tiny_checkpoint(
    out_dir: str | Path, seed: int, tokenizer_dir: str | Path, train: dict | None = None, **dims
) -> dict:
    """Seeded random Qwen3_5ForConditionalGeneration (bf16 safetensors) plus tokenizer, processor,
    generation config and the MTP layer, in out_dir, briefly trained when `train` is given (train_model's
    arguments; its `mtp`, when given, trains the MTP layer afterwards: lib/tiny/mtp.train_and_measure). Same seed,
    tokenizer and training -> same bytes. Returns {"config", "training"}."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t, _ in SPECIAL_TOKENS}
    config = tiny_config(token_ids, round_up(len(tokenizer), 64), **dims)

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**json.loads(json.dumps(config))))
    mtp = _mtp_tensors(config["text_config"], seed)
    stats = None
    if train:
        train = dict(train)
        mtp_plan = train.pop("mtp", None)
        stats = train_model(model, tokenizer, **train)
        if mtp_plan:  # Qwen's MTP objective on the same sequences, the trained main model frozen
            from lib.tiny.mtp import train_and_measure

            mtp, stats["mtp"] = train_and_measure(
                model,
                tokenizer,
                mtp,
                conversations=train["conversations"],
                texts=train.get("texts", []),
                text_max_len=train.get("text_max_len", 192),
                seed=train["seed"],
                threads=train["threads"],
                **mtp_plan,
            )
        stats["mtp_first_loss"] = stats["mtp"]["first_loss"] if mtp_plan else None
        stats["mtp_final_loss"] = stats["mtp"]["final_loss"] if mtp_plan else None
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(out_dir)
    if Path(tokenizer_dir).resolve() != out_dir.resolve():
        tokenizer.save_pretrained(out_dir)

    # transformers has no MTP module: its tensors go into their own shard, listed in the index
    # (vLLM only reads shards the index names once an index exists).
    save_file(mtp, str(out_dir / MTP_FILE), metadata={"format": "pt"})
    shards = sorted(p.name for p in out_dir.glob("*.safetensors") if p.name != MTP_FILE)
    index_path = out_dir / INDEX_FILE
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        assert shards == ["model.safetensors"], shards
        index = {
            "metadata": {},
            "weight_map": {name: "model.safetensors" for name in sorted(read_header(out_dir / shards[0]))},
        }
    index["weight_map"].update({name: MTP_FILE for name in mtp})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index["metadata"]["total_size"] = sum(
        tensor_bytes(info) for f in set(index["weight_map"].values()) for info in read_header(out_dir / f).values()
    )
    write_json(index_path, index)

    # transformers writes its own config.json: put back the keys it does not model (MTP and
    # friends) so the file matches the real checkpoint's.
    saved = json.loads((out_dir / "config.json").read_text())
    saved["text_config"].update({k: v for k, v in config["text_config"].items() if k not in saved["text_config"]})
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        saved[key] = config[key]
    write_json(out_dir / "config.json", saved)

    write_json(
        out_dir / "generation_config.json",
        {**generation_config(token_ids), "transformers_version": saved["transformers_version"]},
    )
    write_processor_files(out_dir)
    for path in out_dir.iterdir():  # safetensors writes 0600; a container user other than root must read them
        path.chmod(0o644)
    return {"config": saved, "training": stats}


def generation_config(token_ids: dict[str, int]) -> dict:
    """Qwen3.5's sampling defaults (thinking mode), with the tiny tokenizer's ids."""
    eot, im_end = token_ids["<|endoftext|>"], token_ids["<|im_end|>"]
    return {
        "bos_token_id": eot,
        "do_sample": True,
        "eos_token_id": [im_end, eot],
        "pad_token_id": eot,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def write_processor_files(out_dir: str | Path) -> None:
    """The Qwen3-VL processor: the real checkpoint's two preprocessor files plus the unified
    processor_config.json that transformers 5 writes (vLLM builds the processor for this arch)."""
    out_dir = Path(out_dir)
    write_json(out_dir / "preprocessor_config.json", {**IMAGE_PROCESSOR, "processor_class": "Qwen3VLProcessor"})
    write_json(out_dir / "video_preprocessor_config.json", {**VIDEO_PROCESSOR, "processor_class": "Qwen3VLProcessor"})
    write_json(
        out_dir / "processor_config.json",
        {
            "image_processor": IMAGE_PROCESSOR,
            "processor_class": "Qwen3VLProcessor",
            "video_processor": VIDEO_PROCESSOR,
        },
    )


def build_tiny(
    out_dir: str | Path, corpus: str | Path, seed: int = 0, vocab_size: int = 4096, tokenizer_extra: str = "", **dims
) -> dict:
    """Tokenizer + untrained checkpoint into out_dir (the tiny profile's whole `download`)."""
    train_tokenizer(corpus, vocab_size, out_dir, tokenizer_extra)
    return build_tiny_checkpoint(out_dir, seed, out_dir, **dims)
