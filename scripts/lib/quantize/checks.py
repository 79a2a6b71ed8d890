"""quantize's guards. Before any model is loaded (from the recipe and the safetensors headers only): the
architecture is one the recipe names; every target/ignore pattern matches a module; targets are Linear weights,
not MTP; the group size divides every targeted input dim; no targeted layer is too narrow for the GPU int kernel.
After: the checkpoint reloads; it holds exactly the targeted quantized modules; mtp.* is there and 16-bit; the
source's non-weight files are carried over byte for byte; weights are the expected size; on held-out text the
quantized model agrees with the source within the configured bounds."""

import json
import math
import re
from pathlib import Path

from lib.quantize.vocab import MULTIPLE, pruned_header
from lib.safetensors import checkpoint_header
from lib.stage import StageError, sha256_file

# Weights and indexes are rewritten by the quantizer; everything else in the source dir
# (tokenizer, chat template, processor/generation configs) must reach the serving image as is.
_REWRITTEN = re.compile(r"(\.safetensors|\.safetensors\.index\.json|\.bin|\.bin\.index\.json|^config\.json)$")

# vLLM's GPU int4/int8 weight-only kernel (Marlin) tiles the output dim by 64 and the input dim by 128.
KERNEL_MIN_OUT, KERNEL_MIN_IN = 64, 128
_DTYPE_BYTES = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "I8": 1,
    "U8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}

# ---- recipe and checkpoint, read without torch (the guards that run before anything is loaded) ----


def checkpoint_modules(header: dict[str, dict]) -> dict[str, list[int]]:
    """Module name -> weight shape, for every module with a `.weight` (Linear weights are the 2-D ones)."""
    return {name[: -len(".weight")]: info["shape"] for name, info in header.items() if name.endswith(".weight")}


HEAD_MODULE = "lm_head"
HEAD, EMBEDDING = f"{HEAD_MODULE}.weight", "model.language_model.embed_tokens.weight"


def tie_flags(config: dict) -> tuple[bool, bool]:
    """tie_word_embeddings of config.json's text config (the one vLLM reads) and of its top level."""
    text = (config.get("text_config") or config).get("tie_word_embeddings")
    top = config.get("tie_word_embeddings")
    text = top if text is None else text  # a level that does not say follows the other
    return bool(text), bool(text if top is None else top)


def head_is_tied(config: dict, header: dict[str, dict]) -> bool:
    """Whether the LM head is the input embedding (Qwen3.5-4B's layout: tie_word_embeddings and no
    lm_head tensor)."""
    return tie_flags(config)[0] and not any(n.startswith(f"{HEAD_MODULE}.") for n in header)


def untied_header(header: dict[str, dict]) -> dict[str, dict]:
    """The header once the head is untied: lm_head.weight a copy of the embedding (same shape and dtype)."""
    if EMBEDDING not in header:
        raise StageError(f"cannot untie the LM head: the checkpoint has no {EMBEDDING}")
    return {**header, HEAD: dict(header[EMBEDDING])}


def _matches(name: str, pattern: str) -> bool:
    # compressed-tensors' rule: "re:" patterns re.match the module name, anything else must equal it
    return re.match(pattern[3:], name) is not None if pattern.startswith("re:") else name == pattern


def _some(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_head_untying(recipe: dict, tied_head: bool) -> None:
    """A tied head cannot be quantized in place (it is the embedding): the recipe must say to untie it,
    and must not untie a head it leaves 16-bit (that only adds a copy of the embedding)."""
    head_targets = [
        p
        for g in recipe["groups"]
        for p in g["targets"]
        if _matches(HEAD_MODULE, p) and not any(_matches(HEAD_MODULE, i) for i in g["ignore"])
    ]
    where = f"recipe {recipe['path']}: pipeline.untie_head"
    if tied_head and head_targets and not recipe["untie_head"]:
        raise StageError(
            f"{where} is not set, but targets {', '.join(map(repr, head_targets))} would quantize lm_head and the "
            "checkpoint ties its LM head to the input embedding (tie_word_embeddings, no lm_head.weight): set "
            "pipeline.untie_head: true to give the head its own copy first, or drop lm_head from the targets"
        )
    if recipe["untie_head"] and not recipe["quantize"]:
        raise StageError(f"{where} is set on a recipe that quantizes nothing: an untied 16-bit head only costs bytes")
    if recipe["untie_head"] and tied_head and not head_targets:
        raise StageError(
            f"{where} is set but no target quantizes lm_head: an untied 16-bit head is a second copy of the "
            "embedding on disk and saves nothing per step"
        )


def plan_targets(
    recipe: dict, architecture: str, modules: dict[str, list[int]], tied_head: bool = False
) -> tuple[dict, dict]:
    """Check the recipe against the checkpoint before anything runs. Returns (module -> weight args of
    every module the recipe will quantize, pattern -> modules it matches); raises naming every problem.
    `modules` are those of the checkpoint as quantized: with the head already untied when the recipe unties it."""
    if architecture not in recipe["architectures"]:
        raise StageError(
            f"the checkpoint's architecture {architecture} is not one recipe {recipe['path']} knows "
            f"({', '.join(recipe['architectures'])})"
        )
    _check_head_untying(recipe, tied_head)
    problems, counts, targeted = [], {}, {}
    for group in recipe["groups"]:
        if not group["targets"]:
            problems.append(f"{group['modifier']}.{group['group']} has no targets")
        for kind in ("targets", "ignore"):
            for pattern in group[kind]:
                counts[pattern] = sum(_matches(m, pattern) for m in modules)
                if not counts[pattern]:
                    hint = (
                        " (a class name such as Linear cannot be checked against the checkpoint: write a "
                        "module-name pattern, re:...)"
                        if kind == "targets" and not pattern.startswith("re:")
                        else ""
                    )
                    problems.append(f"{kind} pattern {pattern!r} matches no module of the checkpoint{hint}")
        for module in modules:
            if any(_matches(module, p) for p in group["targets"]) and not any(
                _matches(module, p) for p in group["ignore"]
            ):
                if module in targeted and targeted[module] != group["weights"]:
                    problems.append(f"{module} is targeted by two config groups with different weights")
                targeted[module] = group["weights"]
    not_linear = sorted(m for m in targeted if len(modules[m]) != 2)
    if not_linear:
        problems.append(f"targets match modules that are not Linear layers: {_some(not_linear)}")
    mtp = sorted(m for m in targeted if m.startswith("mtp."))
    if mtp:
        problems.append(
            f"targets match MTP modules ({_some(mtp)}), which transformers does not load and vLLM reads "
            "as 16-bit: add re:^mtp\\. to ignore"
        )
    linear = {m: targeted[m] for m in targeted if len(modules[m]) == 2}
    indivisible = sorted(
        f"{m} (in {modules[m][1]})"
        for m, w in linear.items()
        if w["strategy"] == "group" and modules[m][1] % w["group_size"]
    )
    if indivisible:
        problems.append(f"group size does not divide the input dim of {_some(indivisible)}")
    narrow = sorted(
        f"{m} [{modules[m][0]}x{modules[m][1]}]"
        for m in linear
        if modules[m][0] % KERNEL_MIN_OUT or modules[m][1] % KERNEL_MIN_IN
    )
    if narrow:
        problems.append(
            f"too narrow for the GPU int{'/'.join(sorted({str(w['num_bits']) for w in linear.values()}))} "
            f"kernel (Marlin needs out_features a multiple of {KERNEL_MIN_OUT} and in_features a multiple "
            f"of {KERNEL_MIN_IN}); keep these 16-bit: {_some(narrow)}"
        )
    if recipe["quantize"] and not targeted and not problems:
        problems.append("the targets select no module once ignore is applied")
    if problems:
        raise StageError(f"recipe {recipe['path']} does not fit the checkpoint: " + "; ".join(problems))
    return targeted, counts


def plan_checkpoint(recipe: dict, config: dict, header: dict[str, dict]) -> dict:
    """plan_targets on a checkpoint's config.json and safetensors header, pruned and with a tied head untied when
    the recipe says so. Returns the architecture, vocab_rows (before pruning), tied_head, untie, the header as it
    will be quantized, targeted and pattern_counts."""
    architecture = (config.get("architectures") or ["AutoModelForCausalLM"])[0]
    rows = (config.get("text_config") or config)["vocab_size"]
    prune = recipe["prune_vocab"]
    if prune and not MULTIPLE <= prune["size"] < rows:
        raise StageError(
            f"recipe {recipe['path']}: pipeline.prune_vocab.size {prune['size']} must be at least {MULTIPLE} and below "
            f"the checkpoint's {rows} vocabulary rows"
        )
    if prune:  # planned against the checkpoint as pruned
        header = pruned_header(header, rows, prune["size"])
    tied = head_is_tied(config, header)
    untie = tied and recipe["untie_head"]
    planned = untied_header(header) if untie else header
    targeted, counts = plan_targets(recipe, architecture, checkpoint_modules(planned), tied)
    return {
        "architecture": architecture,
        "vocab_rows": rows,
        "tied_head": tied,
        "untie": untie,
        "header": planned,
        "targeted": targeted,
        "pattern_counts": counts,
    }


def expected_weight_bytes(header: dict[str, dict], targeted: dict[str, dict]) -> int:
    """Tensor bytes of the checkpoint once `targeted` modules are packed (int32-packed weights, one
    16-bit scale per group or channel, the 2-int64 weight_shape, zero points when asymmetric)."""
    total = 0
    for name, info in header.items():
        weights = targeted.get(name[: -len(".weight")]) if name.endswith(".weight") else None
        if not weights:
            total += info["bytes"]
            continue
        out, inp = info["shape"]
        bits = weights["num_bits"]
        groups = math.ceil(inp / weights["group_size"]) if weights["strategy"] == "group" else 1
        total += out * math.ceil(inp * bits / 32) * 4 + out * groups * _DTYPE_BYTES[info["dtype"]] + 16
        if not weights.get("symmetric", True):
            total += math.ceil(out * bits / 32) * groups * 4
    return total


# ---- the checks on what was written ----


def carried_files(model_dir: Path) -> list[str]:
    # dotfiles are other tools' markers (Snakemake's .snakemake_timestamp), not part of the checkpoint
    return sorted(
        p.name
        for p in model_dir.iterdir()
        if p.is_file() and not p.name.startswith(".") and not _REWRITTEN.search(p.name)
    )


def _head_layout_problem(model_dir: Path, out_dir: Path, source: dict, written: dict, head_quantized: bool):
    """The written config must tie the head exactly when the source did and the head stayed 16-bit: a
    quantized head under a tying text config is silently replaced by the 16-bit embedding in vLLM."""
    configs = [json.loads((d / "config.json").read_text()) for d in (model_dir, out_dir)]
    expect_tied = head_is_tied(configs[0], source) and not head_quantized
    text_flag, top_flag = tie_flags(configs[1])
    head_tensors = sorted(n for n in written if n.startswith(f"{HEAD_MODULE}."))
    if expect_tied == text_flag == top_flag and not (expect_tied and head_tensors):
        return None
    return (
        f"the LM head should be {'tied to the embedding' if expect_tied else 'its own tensor'}, but config.json "
        f"has text_config.tie_word_embeddings={text_flag}, tie_word_embeddings={top_flag} and "
        f"{len(head_tensors)} lm_head tensors"
    )


def check_output(
    model_dir: str | Path,
    out_dir: str | Path,
    targeted: dict,
    expected_bytes: int,
    size_tolerance: float = 0.02,
    head_quantized: bool = False,
) -> dict:
    """After-guards that need no model: quantized modules are exactly the targeted ones, the head is tied
    or not as planned, mtp.* is there and 16-bit, non-weight files are the source's, and tensor bytes are
    the expected size."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    source, written = checkpoint_header(model_dir), checkpoint_header(out_dir)
    problems = [p for p in [_head_layout_problem(model_dir, out_dir, source, written, head_quantized)] if p]
    quantized = sorted(n[: -len(".weight_scale")] for n in written if n.endswith(".weight_scale"))
    if set(quantized) != set(targeted):
        problems.append(
            f"{len(quantized)} quantized modules where the recipe targets {len(targeted)} "
            f"(missing: {_some(sorted(set(targeted) - set(quantized))) or '-'}; "
            f"unexpected: {_some(sorted(set(quantized) - set(targeted))) or '-'})"
        )
    mtp_source = sorted(n for n in source if n.startswith("mtp."))
    mtp_missing = sorted(set(mtp_source) - set(written))
    mtp_wrong = sorted(n for n in written if n.startswith("mtp.") and written[n]["dtype"] not in ("BF16", "F16"))
    if mtp_missing or mtp_wrong:
        problems.append(
            f"MTP tensors not carried over intact (missing: {_some(mtp_missing) or '-'}; "
            f"not 16-bit: {_some(mtp_wrong) or '-'})"
        )
    carried = carried_files(model_dir)
    differ = [
        n for n in carried if not (out_dir / n).is_file() or sha256_file(out_dir / n) != sha256_file(model_dir / n)
    ]
    if differ:
        problems.append(f"files not carried over from the source as they are: {_some(differ)}")
    names = {p.name for p in out_dir.iterdir()}
    tokenizer_config = (
        json.loads((out_dir / "tokenizer_config.json").read_text()) if "tokenizer_config.json" in names else {}
    )
    needed = {
        "tokenizer_config.json": "tokenizer_config.json" in names,
        "a tokenizer (tokenizer.json, tokenizer.model or vocab.json)": bool(
            names & {"tokenizer.json", "tokenizer.model", "vocab.json"}
        ),
        "a chat template": bool(names & {"chat_template.jinja", "chat_template.json"})
        or "chat_template" in tokenizer_config,
        "processor_config.json (vLLM needs it for this architecture)": "processor_config.json" in names
        or "processor_config.json" not in {p.name for p in model_dir.iterdir()},
    }
    missing = [what for what, ok in needed.items() if not ok]
    if missing:
        problems.append(f"the checkpoint lacks {', '.join(missing)}")
    weight_bytes = sum(info["bytes"] for info in written.values())
    if abs(weight_bytes / expected_bytes - 1) > size_tolerance:
        problems.append(
            f"weights are {weight_bytes} bytes where the recipe predicts {expected_bytes} "
            f"(more than {size_tolerance:.0%} off)"
        )
    if problems:
        raise StageError(f"the written checkpoint {out_dir} failed its checks: " + "; ".join(problems))
    return {
        "quantized_module_names": quantized,
        "mtp_tensors": len([n for n in written if n.startswith("mtp.")]),
        "carried_over": carried,
        "weight_bytes": weight_bytes,
    }


def check_heldout(stats: dict, min_top1_agreement: float, max_ppl_ratio: float) -> None:
    problems = []
    if stats["top1_agreement"] < min_top1_agreement:
        problems.append(f"next-token agreement with the source {stats['top1_agreement']:.4f} < {min_top1_agreement}")
    if stats["ppl_ratio"] > max_ppl_ratio:
        problems.append(f"perplexity ratio to the source {stats['ppl_ratio']:.4f} > {max_ppl_ratio}")
    if problems:
        raise StageError(
            f"on the held-out text ({stats['tokens']} tokens) "
            + " and ".join(problems)
            + " (bounds: config quantize.min_top1_agreement / quantize.max_ppl_ratio)"
        )


# ---- held-out agreement with the source (torch) ----


def heldout_ids(tokenizer, path: str | Path, max_tokens: int) -> list[int]:
    if not Path(path).is_file():
        raise StageError(f"held-out text not found: {path}")
    ids = tokenizer(Path(path).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"][:max_tokens]
    if len(ids) < 16:
        raise StageError(f"held-out text {path} gives {len(ids)} tokens; at least 16 are needed")
    return ids


def next_token_stats(model, ids: list[int], window: int = 512):
    """Greedy next-token ids and per-token NLL over `ids`, in windows of `window` tokens."""
    import torch

    device = next(model.parameters()).device
    predicted, nll = [], []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start : start + window + 1]], device=device)
            logits = model(input_ids=chunk[:, :-1]).logits[0].float()
            target = chunk[0, 1:]
            predicted.append(logits.argmax(-1).cpu())
            nll.append(-torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0].cpu())
    return torch.cat(predicted), torch.cat(nll)


def compare_stats(source, quantized) -> dict:
    (src_top1, src_nll), (q_top1, q_nll) = source, quantized
    src_ppl, q_ppl = math.exp(src_nll.mean().item()), math.exp(q_nll.mean().item())
    return {
        "tokens": int(src_top1.numel()),
        "top1_agreement": round((src_top1 == q_top1).float().mean().item(), 6),
        "source_ppl": round(src_ppl, 4),
        "quantized_ppl": round(q_ppl, 4),
        "ppl_ratio": round(q_ppl / src_ppl, 6),
    }


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(model_dir: str | Path, architecture: str, what: str, device: str | None = None):
    import transformers

    try:
        return getattr(transformers, architecture).from_pretrained(
            str(model_dir), dtype="auto", device_map=device or default_device()
        )
    except Exception as error:  # any load failure means the checkpoint cannot be served as written
        raise StageError(f"the {what} checkpoint {model_dir} does not load with transformers: {error}") from error
