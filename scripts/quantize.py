"""quantize: run the variant's llmcompressor recipe on the source checkpoint (or copy it, for a recipe
without modifiers: the bf16 baseline), check the result, and write a compressed-tensors checkpoint that
vLLM serves, plus a sha256 manifest and a schema-checked report. The guards before and after are
lib/quantize/checks.py's."""

import json
import random
import re
import shutil
import time
from contextlib import nullcontext
from importlib import metadata
from pathlib import Path

from lib.checkpoint import verify_manifest
from lib.dag.recipe import read_recipe
from lib.decode_bytes import A10G_GBPS, bound_ms, part_bytes, step_bytes
from lib.hub import use_fetched_datasets
from lib.quantize.checks import (
    HEAD,
    HEAD_MODULE,
    carried_files,
    check_heldout,
    check_output,
    compare_stats,
    default_device,
    expected_weight_bytes,
    heldout_ids,
    load_model,
    next_token_stats,
    plan_checkpoint,
)
from lib.quantize.vocab import PruneError, plan_kept_ids, required_texts, write_pruned_checkpoint
from lib.safetensors import checkpoint_header
from lib.stage import StageError, sha256_file, validate_json, write_json, write_manifest

SCHEMA = Path(__file__).resolve().parents[1] / "schemas" / "quantize_report.schema.yaml"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def load_calibration_texts(
    source: str,
    num_samples: int,
    seed: int,
    path: str | None = None,
    dataset: str | None = None,
    split: str | None = None,
    text_column: str | None = None,
    revision: str | None = None,
) -> list:
    """Pick `num_samples` calibration samples (seeded, order included). A sample is a string, or a
    list of chat messages when an hf dataset has a `messages` column. An hf dataset is read from the cache
    download_datasets fetched (lib/hub.use_fetched_datasets), with the hub off."""
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
            rows = datasets.load_dataset(dataset, split=split or "train", revision=revision)
        except Exception as error:  # not fetched (the hub is off), or no such split: the user fixes the config
            raise StageError(
                f"cannot load calibration dataset {dataset} (split {split}) from the fetched cache "
                f"(datasets/calibration, made by download_datasets): {type(error).__name__}: {error}"
            ) from error
        column = text_column or ("messages" if "messages" in rows.column_names else "text")
        if column not in rows.column_names or len(rows) == 0:
            raise StageError(
                f"calibration dataset {dataset} has no rows or no column {column!r} (columns: {rows.column_names})"
            )
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
        parts = [" ".join(words[: max(1, len(words) // 2)]), " ".join(words[max(1, len(words) // 2) :])]
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


def _carry_over(model_dir: Path, out_dir: Path) -> list[str]:
    """Source files that are not weights or config.json, copied verbatim over whatever the quantizer
    re-saved (its tokenizer and generation config are re-serialisations, not the model author's files)."""
    names = carried_files(model_dir)
    for name in names:
        shutil.copy2(model_dir / name, out_dir / name)
    return names


def _ensure_mtp(model_dir: Path, out_dir: Path) -> None:
    """The MTP layer is invisible to transformers: make sure its tensors reach the output (checked later)."""
    has_mtp = lambda d: any(n.startswith("mtp.") for n in checkpoint_header(d))  # noqa: E731
    if has_mtp(model_dir) and not has_mtp(out_dir):
        # llmcompressor copies them only when the config names an MTP layer count
        from compressed_tensors.utils import save_mtp_tensors_to_checkpoint

        save_mtp_tensors_to_checkpoint(str(model_dir), str(out_dir))


def _untie_head(model) -> None:
    """The head becomes its own parameter (a copy of the embedding) and both config levels say so: vLLM reads
    the text config's tie_word_embeddings, which llmcompressor's own untying leaves true (it sets the top
    level only), so a quantized head would be dropped for the 16-bit embedding at load."""
    import torch

    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.config.tie_word_embeddings = False
    model.config.get_text_config().tie_word_embeddings = False


def build_checkpoint(
    model_dir: str | Path,
    recipe: dict,
    architecture: str,
    out_dir: str | Path,
    *,
    dataset,
    tokenizer,
    max_seq_length: int,
    heldout: list[int],
    seed: int = 0,
    untie_head: bool = False,
    loaded: tuple | None = None,
) -> tuple:
    """Quantize with the recipe (or copy, when it has no modifiers) into `out_dir`, carry the source's other
    files over, and return the held-out statistics of the source model. `untie_head` gives a tied LM head
    its own copy of the embedding before the recipe runs. `loaded`: (model on the CPU, its held-out statistics)
    when the caller already has them (a pruned checkpoint is loaded once, for its guard and for this)."""
    import torch

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    # on the CPU, where llmcompressor's sequential pipeline expects it; only the held-out pass borrows a GPU
    if loaded:
        model, stats = loaded
    else:
        model = load_model(model_dir, architecture, "source", device="cpu")
        stats = next_token_stats(model.to(default_device()), heldout)
    if not recipe["quantize"]:
        for path in model_dir.iterdir():
            if path.is_file() and not path.name.startswith("."):
                shutil.copy2(path, out_dir / path.name)
        return stats
    from llmcompressor import oneshot

    model.to("cpu")  # llmcompressor's sequential pipeline moves each layer to the accelerator itself
    if untie_head:
        _untie_head(model)
    _seed_everything(seed)
    _skip_pinning_without_accelerator()
    oneshot(
        model=model,
        processor=tokenizer,
        recipe=recipe["path"],
        dataset=dataset,
        num_calibration_samples=len(dataset),
        shuffle_calibration_samples=False,
        max_seq_length=max_seq_length,
        output_dir=str(out_dir),
    )
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    _ensure_mtp(model_dir, out_dir)
    _carry_over(model_dir, out_dir)
    if untie_head:
        # llmcompressor re-saves the source's config.json patching only the text config: the top level would
        # still say tied, and transformers would tie the packed head back to the embedding on load
        config = json.loads((out_dir / "config.json").read_text())
        config["tie_word_embeddings"] = False
        write_json(out_dir / "config.json", config)
    return stats


def prune_checkpoint(
    source_dir: Path, pruned_dir: Path, kept: list[int], architecture: str, heldout_path, heldout: list[int], bounds
) -> tuple[dict, tuple]:
    """lib/vocab's pruned checkpoint, then its guards: the held-out text splits into the same pieces (renumbered)
    and decodes back to itself; on it the pruned model agrees with the source within the quantize bounds.
    Returns the report and (the pruned model back on the CPU, its held-out statistics) for build_checkpoint: the
    round trip proved the pruned tokenizer gives the renumbered ids, so those are its held-out statistics."""
    import torch
    from transformers import AutoTokenizer

    shutil.rmtree(pruned_dir, ignore_errors=True)
    done = write_pruned_checkpoint(source_dir, pruned_dir, kept)
    new_id = {old: new for new, old in enumerate(kept)}
    text = Path(heldout_path).read_text(encoding="utf-8")
    before, after = (AutoTokenizer.from_pretrained(str(d)) for d in (source_dir, pruned_dir))
    old_ids, new_ids = (t(text, add_special_tokens=False)["input_ids"] for t in (before, after))
    if new_ids != [new_id.get(i, -1) for i in old_ids] or after.decode(new_ids) != before.decode(old_ids):
        raise StageError(
            f"after pruning the vocabulary to {len(kept)} ids the held-out text {heldout_path} no longer tokenizes "
            "to the same pieces and back"
        )
    model = load_model(source_dir, architecture, "source")
    source_top1, source_nll = next_token_stats(model, heldout)
    del model
    model = load_model(pruned_dir, architecture, "pruned", device="cpu")
    pruned = next_token_stats(model.to(default_device()), [new_id[i] for i in heldout])
    model.to("cpu")
    mapped = torch.tensor([new_id.get(int(i), -1) for i in source_top1])  # a dropped prediction never agrees
    stats = compare_stats((mapped, source_nll), pruned)
    print(f"held-out after pruning: {stats}", flush=True)
    try:
        check_heldout(stats, bounds["min_top1_agreement"], bounds["max_ppl_ratio"])
    except StageError as error:
        raise StageError(f"vocabulary pruned to {len(kept)} ids: {error}") from error
    return {**done, "tokenizer_roundtrip_tokens": len(new_ids), "heldout": stats}, (model, pruned)


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


def describe_plan(recipe: dict, plan: dict, source_header: dict, expected_bytes: int) -> None:
    untie, header, targeted = plan["untie"], plan["header"], plan["targeted"]  # header: its own lm_head once untied
    print(
        f"recipe {recipe['path']}: {len(targeted)} modules to quantize, expected weights {expected_bytes} bytes "
        f"(source {sum(i['bytes'] for i in source_header.values())}"
        + (f"; the LM head untied: +{header[HEAD]['bytes']} bytes before packing" if untie else "")
        + ")",
        flush=True,
    )


def calibration_data(job, recipe: dict, tokenizer) -> tuple[dict | None, list | None, object]:
    """The calibration section as the report records it, its texts and their tokenized dataset (all None for a
    recipe that does not quantize)."""
    if not recipe["quantize"]:
        return None, None, None
    calib = dict(job.params.calibration)
    calib_file = getattr(job.input, "calibration", None) or calib["path"]
    source = calib["source"]
    if source == "hf_dataset":
        fetched = [getattr(job.input, key, None) for key in ("calibration_cache", "calibration_datasets")]
        if not all(fetched):
            raise StageError("calibration.source hf_dataset: the job has no fetched cache (download_datasets)")
        use_fetched_datasets(*fetched)
    texts = load_calibration_texts(
        source,
        int(calib["num_samples"]),
        int(calib["seed"]),
        path=calib_file,
        dataset=calib["dataset"],
        split=calib["split"],
        revision=calib.get("revision"),
    )
    dataset = build_dataset(tokenizer, texts, int(calib["max_seq_length"]), bool(calib["chat"]))
    calib.update(
        source=source,
        text_file=calib_file,
        samples_used=len(dataset),
        tokens_used=sum(map(len, dataset["input_ids"])),
    )
    print(f"calibration: {calib['samples_used']} samples, {calib['tokens_used']} tokens", flush=True)
    return calib, texts, dataset


def kept_vocabulary(job, recipe: dict, rows: int, tokenizer, model_dir: Path, dataset) -> list[int]:
    """The ids a pruned vocabulary keeps, before any model loads: a size that cannot hold every token the calibration
    set, the held-out text and the kept texts use fails here."""
    required = {i for row in (dataset["input_ids"] if dataset else []) for i in row}
    for text in required_texts([job.input.heldout, *job.input.keep_texts], job.params.keep_sentence):
        required |= set(tokenizer(text, add_special_tokens=False)["input_ids"])
    try:
        kept = plan_kept_ids(
            json.loads((model_dir / "tokenizer.json").read_text()), recipe["prune_vocab"]["size"], required, rows
        )
    except PruneError as error:
        raise StageError(f"recipe {recipe['path']}: pipeline.prune_vocab: {error}") from error
    print(f"vocabulary: {rows} rows -> {len(kept)} ids ({len(required)} required by the data)", flush=True)
    return kept


def build_and_check(job, recipe, plan, bounds, expected_bytes, kept, tokenizer, heldout, calibration) -> dict:
    """The checkpoint quantized (or copied) into a folder aside, checked, then moved to job.output.model; with a
    pruned vocabulary the source is pruned first, and the tokenizer, held-out ids and calibration set made again for
    it. What the checks found."""
    from transformers import AutoTokenizer

    from serving.patches.avx2_fp32 import HalfProductsInFp32

    source_dir = model_dir = Path(job.input.model)
    out_dir, architecture, targeted = Path(job.output.model), plan["architecture"], plan["targeted"]
    calib, texts, dataset = calibration
    seed, max_seq_length = (int(calib["seed"]), int(calib["max_seq_length"])) if calib else (0, 0)
    tmp = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab, loaded, pruned_dir = None, None, out_dir.with_name(f".{out_dir.name}.pruned")
    # bf16 products in fp32 where the layers run on the CPU (serving/patches/avx2_fp32.py says why): on an AVX2-only CPU
    # PyTorch has no fast bf16 GEMM or conv, and AWQ's scale search runs the layers many times. With an accelerator
    # the mode stays off: it would pass every op through Python for nothing.
    with HalfProductsInFp32() if default_device() == "cpu" else nullcontext():
        try:
            if kept is not None:
                vocab, loaded = prune_checkpoint(
                    source_dir, pruned_dir, kept, architecture, job.input.heldout, heldout, bounds
                )
                model_dir = pruned_dir
                tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
                heldout = heldout_ids(tokenizer, job.input.heldout, int(bounds["heldout_tokens"]))
                if dataset is not None:
                    dataset = build_dataset(tokenizer, texts, max_seq_length, bool(calib["chat"]))
            source_stats = build_checkpoint(
                model_dir,
                recipe,
                architecture,
                tmp,
                dataset=dataset,
                tokenizer=tokenizer,
                max_seq_length=max_seq_length,
                heldout=heldout,
                seed=seed,
                untie_head=plan["untie"],
                loaded=loaded,
            )
            loaded = None
            qconfig = _quantization_config(tmp)
            if recipe["quantize"] != bool(qconfig):
                raise StageError(f"{tmp}/config.json {'lacks' if recipe['quantize'] else 'has'} a quantization_config")
            checks = check_output(model_dir, tmp, targeted, expected_bytes, head_quantized=HEAD_MODULE in targeted)
            written = load_model(tmp, architecture, "written")
            heldout_stats = compare_stats(source_stats, next_token_stats(written, heldout))
            heldout_stats.update(
                path=str(job.input.heldout),
                min_top1_agreement=bounds["min_top1_agreement"],
                max_ppl_ratio=bounds["max_ppl_ratio"],
            )
            print(f"held-out: {heldout_stats}", flush=True)
            check_heldout(heldout_stats, bounds["min_top1_agreement"], bounds["max_ppl_ratio"])
            shutil.rmtree(out_dir, ignore_errors=True)
            tmp.rename(out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(pruned_dir, ignore_errors=True)
    return {"checks": checks, "qconfig": qconfig, "heldout": heldout_stats, "vocab": vocab}


def quantize_report(job, recipe: dict, plan: dict, calib: dict | None, built: dict, started: float) -> dict:
    """The stage's report of the checkpoint main wrote to job.output.model (`built`: what its checks found)."""
    source_dir, out_dir = Path(job.input.model), Path(job.output.model)
    checks, targeted = built["checks"], plan["targeted"]
    manifest = write_manifest(out_dir, job.output.manifest)
    source_bytes, output_bytes = _dir_bytes(source_dir), _dir_bytes(out_dir)
    parts = part_bytes(out_dir)
    decode_step = step_bytes(parts)
    decode_step.update(bound_ms_a10g=round(bound_ms(decode_step["total"], A10G_GBPS), 4), a10g_gbps=A10G_GBPS)
    return {
        "status": "quantized" if recipe["quantize"] else "not quantized",
        "quantized": recipe["quantize"],
        "recipe": {
            "path": str(job.input.recipe),
            "sha256": sha256_file(job.input.recipe),
            "architectures": recipe["architectures"],
            "modifiers": recipe["modifiers"],
            "groups": recipe["groups"],
        },
        "architecture": plan["architecture"],
        "calibration": calib,
        "quantized_modules": len(checks["quantized_module_names"]),
        "quantized_module_names": checks["quantized_module_names"],
        "quantization_config": built["qconfig"],
        "checks": {
            "pattern_matches": plan["pattern_counts"],
            "expected_quantized_modules": len(targeted),
            "mtp_tensors": checks["mtp_tensors"],
            "carried_over": checks["carried_over"],
            "expected_weight_bytes": built["expected_bytes"],
            "weight_bytes": checks["weight_bytes"],
            "heldout": built["heldout"],
        },
        "source_bytes": source_bytes,
        "output_bytes": output_bytes,
        "size_ratio": round(output_bytes / source_bytes, 4),
        "head": {
            "tied_in_source": plan["tied_head"],
            "untied": plan["untie"],
            "untie_bytes": parts["lm_head"] if plan["untie"] else 0,
            "quantized": HEAD_MODULE in targeted,
        },
        "decode_step": decode_step,
        "vocab": built["vocab"] and {**built["vocab"], "size": recipe["prune_vocab"]["size"]},
        "output_files": {name: (out_dir / name).stat().st_size for name in manifest},
        "wall_seconds": round(time.monotonic() - started, 1),
        "versions": _versions(),
    }


def main(job) -> None:
    started = time.monotonic()
    model_dir, out_dir = Path(job.input.model), Path(job.output.model)
    # the source checkpoint as download (or train_tiny) made and verified it: a file changed since is not read
    verify_manifest(model_dir, job.input.model_manifest)
    bounds = dict(job.params.quantize)
    # Guards that need no model come first: a recipe that does not fit fails in a second, not after loading.
    recipe = read_recipe(job.input.recipe)
    source_config, source_header = json.loads((model_dir / "config.json").read_text()), checkpoint_header(model_dir)
    plan = plan_checkpoint(recipe, source_config, source_header)
    expected_bytes = expected_weight_bytes(plan["header"], plan["targeted"])
    describe_plan(recipe, plan, source_header, expected_bytes)

    import torch
    from transformers import AutoTokenizer

    if getattr(job, "threads", None):
        torch.set_num_threads(job.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    heldout = heldout_ids(tokenizer, job.input.heldout, int(bounds["heldout_tokens"]))
    calibration = calibration_data(job, recipe, tokenizer)
    prune = recipe["prune_vocab"]  # before any model loads: a size that cannot hold the data's tokens fails here
    kept = kept_vocabulary(job, recipe, plan["vocab_rows"], tokenizer, model_dir, calibration[2]) if prune else None
    built = build_and_check(job, recipe, plan, bounds, expected_bytes, kept, tokenizer, heldout, calibration)
    report = quantize_report(job, recipe, plan, calibration[0], built | {"expected_bytes": expected_bytes}, started)
    validate_json(report, getattr(job.input, "schema", None) or SCHEMA)
    write_json(job.output.report, report)
    print(
        f"{report['status']}: {report['quantized_modules']} modules into {out_dir} ({report['output_bytes']} bytes, "
        f"{report['size_ratio']:.2f} of the source) in {report['wall_seconds']:.0f} s",
        flush=True,
    )


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
