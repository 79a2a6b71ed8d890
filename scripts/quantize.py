"""quantize: run the variant's llmcompressor recipe on the source checkpoint (or copy it, for a recipe
without modifiers: the bf16 baseline), check the result, and write a compressed-tensors checkpoint that
vLLM serves, plus a sha256 manifest and a schema-checked report.

Guards, before any model is loaded (from the recipe and the safetensors headers only): the architecture is
one the recipe names; every target/ignore pattern matches a module; targets are Linear weights, not MTP;
the group size divides every targeted input dim; no targeted layer is too narrow for the GPU int kernel.
After: the checkpoint reloads; it holds exactly the targeted quantized modules; mtp.* is there and 16-bit;
the source's non-weight files are carried over byte for byte; weights are the expected size; on held-out
text the quantized model agrees with the source within the configured bounds."""

import json
import math
import random
import re
import shutil
import time
from importlib import metadata
from pathlib import Path

from common import StageError, sha256_file, validate_json, write_json, write_manifest

# Weights and indexes are rewritten by the quantizer; everything else in the source dir
# (tokenizer, chat template, processor/generation configs) must reach the serving image as is.
_REWRITTEN = re.compile(r"(\.safetensors|\.safetensors\.index\.json|\.bin|\.bin\.index\.json|^config\.json)$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# vLLM's GPU int4/int8 weight-only kernel (Marlin) tiles the output dim by 64 and the input dim by 128.
KERNEL_MIN_OUT, KERNEL_MIN_IN = 64, 128
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}
SCHEMA = Path(__file__).resolve().parents[1] / "schemas" / "quantize_report.schema.yaml"


def load_calibration_texts(source: str, num_samples: int, seed: int, path: str | None = None,
                           dataset: str | None = None, split: str | None = None,
                           text_column: str | None = None) -> list:
    """Pick `num_samples` calibration samples (seeded, order included). A sample is a string, or a
    list of chat messages when an hf dataset has a `messages` column."""
    if not isinstance(num_samples, int) or num_samples <= 0:
        raise StageError(f"calibration.num_samples must be a positive integer, got {num_samples!r}")
    rng = random.Random(seed)
    if source == "text_file":
        if not path or not Path(path).is_file():
            raise StageError(f"calibration text file not found: {path}")
        pool = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        if not pool:
            raise StageError(f"calibration text file {path} has no non-empty lines")
        return [pool[i] for i in rng.sample(range(len(pool)), min(num_samples, len(pool)))]
    if source == "hf_dataset":
        if not dataset:
            raise StageError("calibration.source is hf_dataset but calibration.dataset is not set")
        import datasets

        try:
            rows = datasets.load_dataset(dataset, split=split or "train")
        except Exception as error:  # hub/network/split errors: the user fixes the config
            raise StageError(f"cannot load calibration dataset {dataset} (split {split}): {error}") from error
        column = text_column or ("messages" if "messages" in rows.column_names else "text")
        if column not in rows.column_names or len(rows) == 0:
            raise StageError(f"calibration dataset {dataset} has no rows or no column {column!r} "
                             f"(columns: {rows.column_names})")
        picked = rows.select(rng.sample(range(len(rows)), min(num_samples, len(rows))))[column]
        picked = [p for p in picked if p]
        if not picked:
            raise StageError(f"calibration dataset {dataset}: the selected samples are all empty")
        return picked
    raise StageError(f"calibration.source must be text_file or hf_dataset, got {source!r}")


def _as_chat(sample) -> list[dict]:
    if isinstance(sample, list):
        return sample
    # Plain paragraphs become a user turn (first sentence) answered by the rest, so the
    # calibration activations include the chat template's role tokens as served.
    parts = _SENTENCE_END.split(sample, maxsplit=1)
    if len(parts) < 2:  # one sentence: split it by words instead
        words = sample.split()
        parts = [" ".join(words[: max(1, len(words) // 2)]), " ".join(words[max(1, len(words) // 2):])]
    return [{"role": "user", "content": parts[0]}, {"role": "assistant", "content": parts[1]}]


def build_dataset(tokenizer, texts: list, max_seq_length: int, chat: bool):
    """Tokenized `datasets.Dataset` (input_ids, attention_mask), truncated to max_seq_length."""
    import datasets

    rows = {"input_ids": [], "attention_mask": []}
    for sample in texts:
        if chat or isinstance(sample, list):
            text = tokenizer.apply_chat_template(_as_chat(sample), tokenize=False, enable_thinking=False)
            ids = tokenizer(text, add_special_tokens=False, truncation=True, max_length=max_seq_length)["input_ids"]
        else:
            ids = tokenizer(sample, truncation=True, max_length=max_seq_length)["input_ids"]
        if ids:
            rows["input_ids"].append(ids)
            rows["attention_mask"].append([1] * len(ids))
    if not rows["input_ids"]:
        raise StageError("no calibration sample produced any tokens")
    return datasets.Dataset.from_dict(rows)


def _skip_pinning_without_accelerator() -> None:
    import torch

    if torch.accelerator.is_available():
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    # AWQ pins cached activations to speed host->GPU copies; with no accelerator pinning raises
    # "Cannot access accelerator device when none is available" and there is nothing to speed up.
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None


def _seed_everything(seed: int) -> None:
    import numpy
    import torch

    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


# ---- recipe and checkpoint, read without torch (the guards that run before anything is loaded) ----

def safetensors_header(directory: str | Path) -> dict[str, dict]:
    """Tensor name -> {dtype, shape, bytes}, from the headers of every shard (no tensor is read)."""
    out = {}
    for shard in sorted(Path(directory).glob("*.safetensors")):
        with open(shard, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                out[name] = {"dtype": info["dtype"], "shape": info["shape"], "bytes": end - begin}
    return out


def checkpoint_modules(header: dict[str, dict]) -> dict[str, list[int]]:
    """Module name -> weight shape, for every module with a `.weight` (Linear weights are the 2-D ones)."""
    return {name[: -len(".weight")]: info["shape"] for name, info in header.items() if name.endswith(".weight")}


def read_recipe(path: str | Path) -> dict:
    """The parts of a recipe the guards need: the architectures it is written for (its own `pipeline:`
    section) and, per config group of each quantizing modifier, targets, ignore and weight args. A recipe
    with no modifiers quantizes nothing (the bf16 baseline)."""
    import yaml

    try:
        recipe = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise StageError(f"cannot read recipe {path}: {error}") from error
    if not isinstance(recipe, dict):
        raise StageError(f"recipe {path} is not a YAML mapping")
    architectures = (recipe.get("pipeline") or {}).get("architectures")
    if not architectures or not isinstance(architectures, list):
        raise StageError(f"recipe {path} has no pipeline.architectures list (the architectures it was written for)")
    modifiers = [(name, args or {}) for key, stage in recipe.items() if key.endswith("_stage") and isinstance(stage, dict)
                 for group_key, group in stage.items() if group_key.endswith("_modifiers") and isinstance(group, dict)
                 for name, args in group.items()]
    groups = []
    for name, args in modifiers:
        if "config_groups" not in args:
            if "scheme" in args or "targets" in args:
                raise StageError(f"recipe {path}: {name} uses scheme/targets; spell the scheme out as config_groups "
                                 "(targets + weights) so the guards can check it against the checkpoint")
            continue  # a transform such as AWQModifier: it quantizes nothing itself
        for group_name, group in args["config_groups"].items():
            weights = group.get("weights") or {}
            if not isinstance(weights.get("num_bits"), int) or weights.get("strategy") not in ("group", "channel"):
                raise StageError(f"recipe {path}: {name}.{group_name}.weights needs integer num_bits and strategy "
                                 f"group or channel, got {weights}")
            if weights["strategy"] == "group" and not (isinstance(weights.get("group_size"), int)
                                                      and weights["group_size"] > 0):
                raise StageError(f"recipe {path}: {name}.{group_name}: strategy group needs a positive group_size")
            groups.append({"modifier": name, "group": group_name, "targets": list(group.get("targets") or []),
                           "ignore": list(args.get("ignore") or []), "weights": weights})
    if modifiers and not groups:
        raise StageError(f"recipe {path} has modifiers but none with config_groups: it would quantize nothing")
    return {"path": str(path), "architectures": architectures, "modifiers": [name for name, _ in modifiers],
            "groups": groups, "quantize": bool(modifiers)}


def _matches(name: str, pattern: str) -> bool:
    # compressed-tensors' rule: "re:" patterns re.match the module name, anything else must equal it
    return re.match(pattern[3:], name) is not None if pattern.startswith("re:") else name == pattern


def _some(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def plan_targets(recipe: dict, architecture: str, modules: dict[str, list[int]]) -> tuple[dict, dict]:
    """Check the recipe against the checkpoint before anything runs. Returns (module -> weight args of
    every module the recipe will quantize, pattern -> modules it matches); raises naming every problem."""
    if architecture not in recipe["architectures"]:
        raise StageError(f"the checkpoint's architecture {architecture} is not one recipe {recipe['path']} knows "
                         f"({', '.join(recipe['architectures'])})")
    problems, counts, targeted = [], {}, {}
    for group in recipe["groups"]:
        if not group["targets"]:
            problems.append(f"{group['modifier']}.{group['group']} has no targets")
        for kind in ("targets", "ignore"):
            for pattern in group[kind]:
                counts[pattern] = sum(_matches(m, pattern) for m in modules)
                if not counts[pattern]:
                    hint = (" (a class name such as Linear cannot be checked against the checkpoint: write a "
                            "module-name pattern, re:...)" if kind == "targets" and not pattern.startswith("re:") else "")
                    problems.append(f"{kind} pattern {pattern!r} matches no module of the checkpoint{hint}")
        for module in modules:
            if any(_matches(module, p) for p in group["targets"]) and not any(_matches(module, p) for p in group["ignore"]):
                if module in targeted and targeted[module] != group["weights"]:
                    problems.append(f"{module} is targeted by two config groups with different weights")
                targeted[module] = group["weights"]
    not_linear = sorted(m for m in targeted if len(modules[m]) != 2)
    if not_linear:
        problems.append(f"targets match modules that are not Linear layers: {_some(not_linear)}")
    mtp = sorted(m for m in targeted if m.startswith("mtp."))
    if mtp:
        problems.append(f"targets match MTP modules ({_some(mtp)}), which transformers does not load and vLLM reads "
                        "as 16-bit: add re:^mtp\\. to ignore")
    linear = {m: targeted[m] for m in targeted if len(modules[m]) == 2}
    indivisible = sorted(f"{m} (in {modules[m][1]})" for m, w in linear.items()
                         if w["strategy"] == "group" and modules[m][1] % w["group_size"])
    if indivisible:
        problems.append(f"group size does not divide the input dim of {_some(indivisible)}")
    narrow = sorted(f"{m} [{modules[m][0]}x{modules[m][1]}]" for m in linear
                    if modules[m][0] % KERNEL_MIN_OUT or modules[m][1] % KERNEL_MIN_IN)
    if narrow:
        problems.append(f"too narrow for the GPU int{'/'.join(sorted({str(w['num_bits']) for w in linear.values()}))} "
                        f"kernel (Marlin needs out_features a multiple of {KERNEL_MIN_OUT} and in_features a multiple "
                        f"of {KERNEL_MIN_IN}); keep these 16-bit: {_some(narrow)}")
    if recipe["quantize"] and not targeted and not problems:
        problems.append("the targets select no module once ignore is applied")
    if problems:
        raise StageError(f"recipe {recipe['path']} does not fit the checkpoint: " + "; ".join(problems))
    return targeted, counts


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

def _carried_files(model_dir: Path) -> list[str]:
    # dotfiles are other tools' markers (Snakemake's .snakemake_timestamp), not part of the checkpoint
    return sorted(p.name for p in model_dir.iterdir()
                  if p.is_file() and not p.name.startswith(".") and not _REWRITTEN.search(p.name))


def _carry_over(model_dir: Path, out_dir: Path) -> list[str]:
    """Source files that are not weights or config.json, copied verbatim over whatever the quantizer
    re-saved (its tokenizer and generation config are re-serialisations, not the model author's files)."""
    names = _carried_files(model_dir)
    for name in names:
        shutil.copy2(model_dir / name, out_dir / name)
    return names


def check_output(model_dir: str | Path, out_dir: str | Path, targeted: dict, expected_bytes: int,
                 size_tolerance: float = 0.02) -> dict:
    """After-guards that need no model: quantized modules are exactly the targeted ones, mtp.* is there
    and 16-bit, non-weight files are the source's, and tensor bytes are the expected size."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    source, written = safetensors_header(model_dir), safetensors_header(out_dir)
    problems = []
    quantized = sorted(n[: -len(".weight_scale")] for n in written if n.endswith(".weight_scale"))
    if set(quantized) != set(targeted):
        problems.append(f"{len(quantized)} quantized modules where the recipe targets {len(targeted)} "
                        f"(missing: {_some(sorted(set(targeted) - set(quantized))) or '-'}; "
                        f"unexpected: {_some(sorted(set(quantized) - set(targeted))) or '-'})")
    mtp_source = sorted(n for n in source if n.startswith("mtp."))
    mtp_missing = sorted(set(mtp_source) - set(written))
    mtp_wrong = sorted(n for n in written if n.startswith("mtp.") and written[n]["dtype"] not in ("BF16", "F16"))
    if mtp_missing or mtp_wrong:
        problems.append(f"MTP tensors not carried over intact (missing: {_some(mtp_missing) or '-'}; "
                        f"not 16-bit: {_some(mtp_wrong) or '-'})")
    carried = _carried_files(model_dir)
    differ = [n for n in carried if not (out_dir / n).is_file() or sha256_file(out_dir / n) != sha256_file(model_dir / n)]
    if differ:
        problems.append(f"files not carried over from the source as they are: {_some(differ)}")
    names = {p.name for p in out_dir.iterdir()}
    tokenizer_config = json.loads((out_dir / "tokenizer_config.json").read_text()) if "tokenizer_config.json" in names else {}
    needed = {"tokenizer_config.json": "tokenizer_config.json" in names,
              "a tokenizer (tokenizer.json, tokenizer.model or vocab.json)": bool(names & {"tokenizer.json", "tokenizer.model", "vocab.json"}),
              "a chat template": bool(names & {"chat_template.jinja", "chat_template.json"}) or "chat_template" in tokenizer_config,
              "processor_config.json (vLLM needs it for this architecture)": "processor_config.json" in names or
              "processor_config.json" not in {p.name for p in model_dir.iterdir()}}
    missing = [what for what, ok in needed.items() if not ok]
    if missing:
        problems.append(f"the checkpoint lacks {', '.join(missing)}")
    weight_bytes = sum(info["bytes"] for info in written.values())
    if abs(weight_bytes / expected_bytes - 1) > size_tolerance:
        problems.append(f"weights are {weight_bytes} bytes where the recipe predicts {expected_bytes} "
                        f"(more than {size_tolerance:.0%} off)")
    if problems:
        raise StageError(f"the written checkpoint {out_dir} failed its checks: " + "; ".join(problems))
    return {"quantized_module_names": quantized, "mtp_tensors": len([n for n in written if n.startswith("mtp.")]),
            "carried_over": carried, "weight_bytes": weight_bytes}


def check_heldout(stats: dict, min_top1_agreement: float, max_ppl_ratio: float) -> None:
    problems = []
    if stats["top1_agreement"] < min_top1_agreement:
        problems.append(f"next-token agreement with the source {stats['top1_agreement']:.4f} < {min_top1_agreement}")
    if stats["ppl_ratio"] > max_ppl_ratio:
        problems.append(f"perplexity ratio to the source {stats['ppl_ratio']:.4f} > {max_ppl_ratio}")
    if problems:
        raise StageError(f"on the held-out text ({stats['tokens']} tokens) " + " and ".join(problems)
                         + " (bounds: config quantize.min_top1_agreement / quantize.max_ppl_ratio)")


# ---- torch side ----

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
            chunk = torch.tensor([ids[start: start + window + 1]], device=device)
            logits = model(input_ids=chunk[:, :-1]).logits[0].float()
            target = chunk[0, 1:]
            predicted.append(logits.argmax(-1).cpu())
            nll.append(-torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0].cpu())
    return torch.cat(predicted), torch.cat(nll)


def compare_stats(source, quantized) -> dict:
    (src_top1, src_nll), (q_top1, q_nll) = source, quantized
    src_ppl, q_ppl = math.exp(src_nll.mean().item()), math.exp(q_nll.mean().item())
    return {"tokens": int(src_top1.numel()), "top1_agreement": round((src_top1 == q_top1).float().mean().item(), 6),
            "source_ppl": round(src_ppl, 4), "quantized_ppl": round(q_ppl, 4), "ppl_ratio": round(q_ppl / src_ppl, 6)}


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(model_dir: str | Path, architecture: str, what: str, device: str | None = None):
    import transformers

    try:
        return getattr(transformers, architecture).from_pretrained(str(model_dir), dtype="auto",
                                                                   device_map=device or _device())
    except Exception as error:  # any load failure means the checkpoint cannot be served as written
        raise StageError(f"the {what} checkpoint {model_dir} does not load with transformers: {error}") from error


def _ensure_mtp(model_dir: Path, out_dir: Path) -> None:
    """The MTP layer is invisible to transformers: make sure its tensors reach the output (checked later)."""
    has_mtp = lambda d: any(n.startswith("mtp.") for n in safetensors_header(d))  # noqa: E731
    if has_mtp(model_dir) and not has_mtp(out_dir):
        # llmcompressor copies them only when the config names an MTP layer count
        from compressed_tensors.utils import save_mtp_tensors_to_checkpoint

        save_mtp_tensors_to_checkpoint(str(model_dir), str(out_dir))


def build_checkpoint(model_dir: str | Path, recipe: dict, architecture: str, out_dir: str | Path, *, dataset,
                     tokenizer, max_seq_length: int, heldout: list[int], seed: int = 0) -> tuple:
    """Quantize with the recipe (or copy, when it has no modifiers) into `out_dir`, carry the source's other
    files over, and return the held-out statistics of the source model."""
    import torch

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    # on the CPU, where llmcompressor's sequential pipeline expects it; only the held-out pass borrows a GPU
    model = load_model(model_dir, architecture, "source", device="cpu")
    stats = next_token_stats(model.to(_device()), heldout)
    if not recipe["quantize"]:
        for path in model_dir.iterdir():
            if path.is_file() and not path.name.startswith("."):
                shutil.copy2(path, out_dir / path.name)
        return stats
    from llmcompressor import oneshot

    model.to("cpu")  # llmcompressor's sequential pipeline moves each layer to the accelerator itself
    _seed_everything(seed)
    _skip_pinning_without_accelerator()
    oneshot(model=model, processor=tokenizer, recipe=recipe["path"], dataset=dataset,
            num_calibration_samples=len(dataset), shuffle_calibration_samples=False,
            max_seq_length=max_seq_length, output_dir=str(out_dir))
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    _ensure_mtp(model_dir, out_dir)
    _carry_over(model_dir, out_dir)
    return stats


def _quantization_config(out_dir: Path):
    saved = json.loads((out_dir / "config.json").read_text())
    return saved.get("quantization_config") or saved.get("text_config", {}).get("quantization_config")


def _dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "transformers", "llmcompressor", "compressed-tensors"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def main(job) -> None:
    started = time.monotonic()
    model_dir, out_dir = Path(job.input.model), Path(job.output.model)
    bounds = dict(job.params.quantize)
    # Guards that need no model come first: a recipe that does not fit fails in a second, not after loading.
    recipe = read_recipe(job.input.recipe)
    config = json.loads((model_dir / "config.json").read_text())
    architecture = (config.get("architectures") or ["AutoModelForCausalLM"])[0]
    header = safetensors_header(model_dir)
    targeted, pattern_counts = plan_targets(recipe, architecture, checkpoint_modules(header))
    expected_bytes = expected_weight_bytes(header, targeted)
    print(f"recipe {recipe['path']}: {len(targeted)} modules to quantize, expected weights {expected_bytes} bytes "
          f"(source {sum(i['bytes'] for i in header.values())})", flush=True)

    import torch
    from transformers import AutoTokenizer

    if getattr(job, "threads", None):
        torch.set_num_threads(job.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    heldout = heldout_ids(tokenizer, job.input.heldout, int(bounds.get("heldout_tokens", 4096)))
    calib, dataset, seed, max_seq_length = None, None, 0, 0
    if recipe["quantize"]:
        calib = dict(job.params.calibration)
        calib_file = getattr(job.input, "calibration", None) or calib.get("path")
        source = calib.get("source") or ("text_file" if calib_file else "hf_dataset")
        seed = int(calib.get("seed", 0))
        max_seq_length = int(calib.get("max_seq_length", 2048))
        texts = load_calibration_texts(source, int(calib.get("num_samples", 256)), seed, path=calib_file,
                                       dataset=calib.get("dataset"), split=calib.get("split"),
                                       text_column=calib.get("text_column"))
        dataset = build_dataset(tokenizer, texts, max_seq_length, bool(calib.get("chat", False)))
        calib.update(source=source, text_file=calib_file, samples_used=len(dataset),
                     tokens_used=sum(map(len, dataset["input_ids"])))
        print(f"calibration: {calib['samples_used']} samples, {calib['tokens_used']} tokens", flush=True)

    tmp = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        source_stats = build_checkpoint(model_dir, recipe, architecture, tmp, dataset=dataset, tokenizer=tokenizer,
                                        max_seq_length=max_seq_length, heldout=heldout, seed=seed)
        qconfig = _quantization_config(tmp)
        if recipe["quantize"] != bool(qconfig):
            raise StageError(f"{tmp}/config.json {'lacks' if recipe['quantize'] else 'has'} a quantization_config")
        checks = check_output(model_dir, tmp, targeted, expected_bytes)
        heldout_stats = compare_stats(source_stats, next_token_stats(load_model(tmp, architecture, "written"), heldout))
        heldout_stats.update(path=str(job.input.heldout), min_top1_agreement=bounds["min_top1_agreement"],
                             max_ppl_ratio=bounds["max_ppl_ratio"])
        print(f"held-out: {heldout_stats}", flush=True)
        check_heldout(heldout_stats, bounds["min_top1_agreement"], bounds["max_ppl_ratio"])
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    manifest = write_manifest(out_dir, job.output.manifest)
    source_bytes, output_bytes = _dir_bytes(model_dir), _dir_bytes(out_dir)
    report = {
        "status": "quantized" if recipe["quantize"] else "not quantized",
        "quantized": recipe["quantize"],
        "recipe": {"path": str(job.input.recipe), "sha256": sha256_file(job.input.recipe),
                   "architectures": recipe["architectures"], "modifiers": recipe["modifiers"],
                   "groups": recipe["groups"]},
        "architecture": architecture,
        "calibration": calib,
        "quantized_modules": len(checks["quantized_module_names"]),
        "quantized_module_names": checks["quantized_module_names"],
        "quantization_config": qconfig,
        "checks": {
            "pattern_matches": pattern_counts,
            "expected_quantized_modules": len(targeted),
            "mtp_tensors": checks["mtp_tensors"],
            "carried_over": checks["carried_over"],
            "expected_weight_bytes": expected_bytes,
            "weight_bytes": checks["weight_bytes"],
            "heldout": heldout_stats,
        },
        "source_bytes": source_bytes,
        "output_bytes": output_bytes,
        "size_ratio": round(output_bytes / source_bytes, 4),
        "output_files": {name: (out_dir / name).stat().st_size for name in manifest},
        "wall_seconds": round(time.monotonic() - started, 1),
        "versions": _versions(),
    }
    validate_json(report, getattr(job.input, "schema", None) or SCHEMA)
    write_json(job.output.report, report)
    print(f"{report['status']}: {report['quantized_modules']} modules into {out_dir} ({output_bytes} bytes, "
          f"{report['size_ratio']:.2f} of the source) in {report['wall_seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    from common import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
