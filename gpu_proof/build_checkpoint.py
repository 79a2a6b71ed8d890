"""A full-size random-weight checkpoint with Qwen3.5-4B's exact text shapes, made on the GPU by the
project's own builder (scripts/lib/tiny: same tensor names, config keys, MTP layer, processor files).

    python3 gpu_proof/build_checkpoint.py OUT_DIR RESULT_JSON [--corpus data/tiny/corpus.txt] [--seed 0]
    python3 gpu_proof/build_checkpoint.py --drafter OUT_DIR RESULT_JSON --target TARGET_DIR   (a random DFlash
        drafter of z-lab/Qwen3.5-4B-DFlash's shapes for that target: scripts/lib/tiny/drafter.py)

(--device cpu with --dims '{...}' --vocab N makes a small one: the tests' check of this script on CPU.)

The tokenizer is the tiny profile's (trained on the bundled corpus; the real one is not reachable offline),
padded with filler tokens to the real vocabulary (248,320 ids) so every id the random model samples
decodes to text. The vision tower stays tiny: the proof serves with --language-model-only, which never
loads it.
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from lib.safetensors import model_part, read_header, tensor_bytes  # noqa: E402
from lib.stage import sha256_file  # noqa: E402
from lib.tiny.drafter import QWEN35_4B_DRAFTER, build_random_drafter  # noqa: E402
from lib.tiny.synthesis import build_tiny_checkpoint  # noqa: E402
from lib.tiny.tokenizer import train_tokenizer  # noqa: E402

# Qwen/Qwen3.5-4B's text model (config.json of the pinned revision).
QWEN35_4B_DIMS = {
    "hidden_size": 2560,
    "intermediate_size": 9216,
    "num_hidden_layers": 32,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144,
    "mtp_num_hidden_layers": 1,
    "tie_word_embeddings": True,  # no lm_head.weight in the real checkpoint
}
QWEN35_4B_VOCAB = 248320


def tensor_groups(model_dir: Path) -> dict:
    """Parameter counts and bytes of the checkpoint, by part (read from the safetensors headers)."""
    groups: dict[str, dict] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        for name, info in read_header(shard).items():
            part = model_part(name)
            part = "decoder_layers_and_norm" if part == "decoder" else part  # the recorded results' name
            numel = 1
            for dim in info["shape"]:
                numel *= dim
            entry = groups.setdefault(part, {"tensors": 0, "params": 0, "bytes": 0})
            entry["tensors"] += 1
            entry["params"] += numel
            entry["bytes"] += tensor_bytes(info)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("result")
    parser.add_argument("--corpus", default=str(ROOT / "data" / "tiny" / "corpus.txt"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dims", default="{}", help="JSON overrides of the Qwen3.5-4B dims (tests only)")
    parser.add_argument("--vocab", type=int, default=QWEN35_4B_VOCAB)
    parser.add_argument("--drafter", action="store_true", help="a random DFlash drafter for --target instead")
    parser.add_argument("--target", help="the target checkpoint a --drafter is made for")
    args = parser.parse_args()

    import torch

    if args.drafter:
        with torch.device(args.device):
            config = build_random_drafter(
                args.out_dir, args.target, QWEN35_4B_DRAFTER | json.loads(args.dims), args.seed
            )
        groups = tensor_groups(Path(args.out_dir))
        result = {
            "kind": "drafter",
            "status": "ok",
            "config": config,
            "total_params": sum(g["params"] for g in groups.values()),
        }
        result["total_bytes"] = sum(g["bytes"] for g in groups.values())
        Path(args.result).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        return

    dims = QWEN35_4B_DIMS | json.loads(args.dims)
    on_gpu = args.device.startswith("cuda")
    out = Path(args.out_dir)
    started = time.monotonic()
    train_tokenizer(args.corpus, 4096, out, pad_to=args.vocab)
    tokenizer_s = time.monotonic() - started
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    build_start = time.monotonic()
    with torch.device(args.device):  # parameters are created and initialised on the GPU
        saved = build_tiny_checkpoint(out, args.seed, out, **dims)["config"]
    if on_gpu:
        torch.cuda.synchronize()
    build_s = time.monotonic() - build_start
    text = saved["text_config"]
    for key, value in dims.items():
        assert text[key] == value, (key, text[key], value)
    assert text["vocab_size"] == args.vocab, text["vocab_size"]
    groups = tensor_groups(out)
    result = {
        "kind": "checkpoint",
        "status": "ok",
        "path": str(out),
        "builder": (
            f"scripts/lib/tiny: train_tokenizer(pad_to={args.vocab}) + build_tiny_checkpoint "
            f"under torch.device('{args.device}')"
        ),
        "seed": args.seed,
        "device": torch.cuda.get_device_name(0) if on_gpu else args.device,
        "architecture": saved["architectures"][0],
        "text_config": {k: text[k] for k in sorted(dims) if k != "layer_types"}
        | {
            "vocab_size": text["vocab_size"],
            "tie_word_embeddings": text["tie_word_embeddings"],
            "full_attention_layers": text["layer_types"].count("full_attention"),
            "linear_attention_layers": text["layer_types"].count("linear_attention"),
        },
        "vision_config": {k: saved["vision_config"][k] for k in ("depth", "hidden_size", "intermediate_size")},
        "tensor_groups": groups,
        "total_params": sum(g["params"] for g in groups.values()),
        "total_bytes": sum(g["bytes"] for g in groups.values()),
        "files": {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()},
        # two hosts whose greedy ids differ can tell whether their weights were the same
        "weights_sha256": {p.name: sha256_file(p) for p in sorted(out.glob("*.safetensors"))},
        "tokenizer_s": round(tokenizer_s, 1),
        "build_s": round(build_s, 1),
        "peak_gpu_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if on_gpu else 0.0,
    }
    Path(args.result).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps({k: result[k] for k in ("total_params", "total_bytes", "build_s")}), flush=True)


if __name__ == "__main__":
    main()
