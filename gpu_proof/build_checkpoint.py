"""A full-size random-weight checkpoint with Qwen3.5-4B's exact text shapes, made on the GPU by the project's own
builder (scripts/lib/tiny: same tensor names, config keys, MTP layer, processor files); its tokenizer is the tiny
profile's (the real one is not reachable offline), padded with filler tokens to the real vocabulary so every id the
random model samples decodes to text; the vision tower stays tiny (the proof serves --language-model-only).

    python3 gpu_proof/build_checkpoint.py OUT_DIR RESULT_JSON [--corpus data/tiny/corpus.txt] [--seed 0]
    python3 gpu_proof/build_checkpoint.py --drafter OUT_DIR RESULT_JSON --target TARGET_DIR   (a random DFlash
        drafter of z-lab/Qwen3.5-4B-DFlash's shapes for that target: scripts/lib/tiny/drafter.py)

(--device cpu with --dims '{...}' --vocab N makes a small one: the tests' check of this script on CPU.)
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from lib.safetensors import checkpoint_header  # noqa: E402
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


def totals(model_dir: Path) -> dict:
    """Parameters and bytes of the checkpoint (from the safetensors headers)."""
    tensors = checkpoint_header(model_dir).values()
    params = sum(math.prod(t["shape"]) for t in tensors)
    return {"total_params": params, "total_bytes": sum(t["bytes"] for t in tensors)}


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
        dims = QWEN35_4B_DRAFTER | json.loads(args.dims)
        with torch.device(args.device):
            config = build_random_drafter(args.out_dir, args.target, dims, args.seed)
        result = {"kind": "drafter", "status": "ok", "config": config, **totals(Path(args.out_dir))}
        Path(args.result).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        return

    dims = QWEN35_4B_DIMS | json.loads(args.dims)
    out = Path(args.out_dir)
    started = time.monotonic()
    train_tokenizer(args.corpus, 4096, out, pad_to=args.vocab)
    with torch.device(args.device):  # parameters are created and initialised on the GPU
        saved = build_tiny_checkpoint(out, args.seed, out, **dims)["config"]
    text = saved["text_config"]
    for key, value in dims.items():
        assert text[key] == value, (key, text[key], value)
    assert text["vocab_size"] == args.vocab, text["vocab_size"]
    builder = f"scripts/lib/tiny: train_tokenizer(pad_to={args.vocab}) + build_tiny_checkpoint on {args.device}"
    result = {"kind": "checkpoint", "status": "ok", "path": str(out), "builder": builder, "seed": args.seed}
    result["architecture"] = saved["architectures"][0]
    result["text_config"] = {k: text[k] for k in sorted(dims) if k != "layer_types"} | {"vocab_size": args.vocab}
    # two hosts whose greedy ids differ can tell whether their weights were the same
    result["weights_sha256"] = {p.name: sha256_file(p) for p in sorted(out.glob("*.safetensors"))}
    result |= {"build_s": round(time.monotonic() - started, 1), **totals(out)}
    Path(args.result).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps({k: result[k] for k in ("total_params", "total_bytes", "build_s")}), flush=True)


if __name__ == "__main__":
    main()
