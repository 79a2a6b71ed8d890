"""quantize: AWQ int4 (W4A16, group 32) of the source checkpoint with llmcompressor, written as a
compressed-tensors checkpoint that vLLM serves, plus a manifest and a report."""

import json
import os
import random
import re
import shutil
import time
from importlib import metadata
from pathlib import Path

from common import StageError, sha256_file, write_json, write_manifest

# Weights and indexes are rewritten by the quantizer; everything else in the source dir
# (tokenizer, chat template, processor/generation configs) must reach the serving image as is.
_REWRITTEN = re.compile(r"(\.safetensors|\.safetensors\.index\.json|\.bin|\.bin\.index\.json|^config\.json)$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


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


def _safetensors_dtypes(directory: Path) -> dict[str, str]:
    """Tensor name -> dtype, read from the safetensors headers only."""
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with open(shard, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        out.update({name: info["dtype"] for name, info in header.items() if name != "__metadata__"})
    return out


def _ensure_mtp(model_dir: Path, out_dir: Path) -> int:
    """The MTP layer is invisible to transformers: make sure its 16-bit tensors reach the output."""
    source = [n for n in _safetensors_dtypes(model_dir) if n.startswith("mtp.")]
    if not source:
        return 0
    if not any(n.startswith("mtp.") for n in _safetensors_dtypes(out_dir)):
        # llmcompressor copies them only when the config names an MTP layer count
        from compressed_tensors.utils import save_mtp_tensors_to_checkpoint

        save_mtp_tensors_to_checkpoint(str(model_dir), str(out_dir))
    written = {n: d for n, d in _safetensors_dtypes(out_dir).items() if n.startswith("mtp.")}
    missing = sorted(set(source) - set(written))
    wrong = sorted(n for n, d in written.items() if d not in ("BF16", "F16"))
    if missing or wrong:
        raise StageError(f"MTP tensors not carried over intact: missing {missing[:5]}, not 16-bit {wrong[:5]}")
    return len(written)


def _carry_over(model_dir: Path, out_dir: Path) -> list[str]:
    copied = []
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and not _REWRITTEN.search(path.name) and not (out_dir / path.name).exists():
            shutil.copy2(path, out_dir / path.name)
            copied.append(path.name)
    return copied


def quantize(model_dir: str | Path, recipe: str | Path, dataset, out_dir: str | Path, *,
             tokenizer, max_seq_length: int, seed: int = 0, threads: int | None = None) -> dict:
    """Run the recipe on the model with `dataset` and write a compressed-tensors checkpoint to
    `out_dir` (atomically: built in a sibling temp dir, renamed at the end)."""
    import torch
    import transformers
    from llmcompressor import oneshot

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if threads:
        torch.set_num_threads(threads)
    _seed_everything(seed)
    _skip_pinning_without_accelerator()

    config = json.loads((model_dir / "config.json").read_text())
    architecture = (config.get("architectures") or ["AutoModelForCausalLM"])[0]
    model_class = getattr(transformers, architecture)
    model = model_class.from_pretrained(str(model_dir), dtype="auto")

    tmp = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        oneshot(model=model, processor=tokenizer, recipe=str(recipe), dataset=dataset,
                num_calibration_samples=len(dataset), shuffle_calibration_samples=False,
                max_seq_length=max_seq_length, output_dir=str(tmp))
        saved = json.loads((tmp / "config.json").read_text())
        qconfig = saved.get("quantization_config") or saved.get("text_config", {}).get("quantization_config")
        if not qconfig:
            raise StageError(f"{tmp}/config.json has no quantization_config after oneshot")
        mtp_tensors = _ensure_mtp(model_dir, tmp)
        copied = _carry_over(model_dir, tmp)
        names = _safetensors_dtypes(tmp)
        quantized = sorted(n[: -len(".weight_packed")] for n in names if n.endswith(".weight_packed"))
        if not quantized:
            raise StageError("oneshot wrote no packed (quantized) weights; check the recipe targets")
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"quantized_modules": len(quantized), "quantized_module_names": quantized,
            "mtp_tensors": mtp_tensors, "copied_from_source": copied,
            "quantization_config": json.loads((out_dir / "config.json").read_text()).get("quantization_config")}


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
    from transformers import AutoTokenizer

    started = time.monotonic()
    calib = dict(job.params.calibration)
    calib_file = getattr(job.input, "calibration", None) or calib.get("path")
    source = calib.get("source") or ("text_file" if calib_file else "hf_dataset")
    seed = int(calib.get("seed", 0))
    max_seq_length = int(calib.get("max_seq_length", 2048))
    texts = load_calibration_texts(source, int(calib.get("num_samples", 256)), seed, path=calib_file,
                                   dataset=calib.get("dataset"), split=calib.get("split"),
                                   text_column=calib.get("text_column"))
    tokenizer = AutoTokenizer.from_pretrained(job.input.model)
    dataset = build_dataset(tokenizer, texts, max_seq_length, bool(calib.get("chat", False)))
    print(f"calibration: {len(dataset)} samples, {sum(map(len, dataset['input_ids']))} tokens", flush=True)

    out_dir = Path(job.output.model)
    result = quantize(job.input.model, job.input.recipe, dataset, out_dir, tokenizer=tokenizer,
                      max_seq_length=max_seq_length, seed=seed, threads=getattr(job, "threads", None))
    manifest = write_manifest(out_dir, job.output.manifest)
    write_json(job.output.report, {
        "recipe": {"path": str(job.input.recipe), "sha256": sha256_file(job.input.recipe)},
        "calibration": {**calib, "source": source, "text_file": calib_file,
                        "samples_used": len(dataset),
                        "tokens_used": sum(map(len, dataset["input_ids"]))},
        "quantized_modules": result["quantized_modules"],
        "quantized_module_names": result["quantized_module_names"],
        "mtp_tensors": result["mtp_tensors"],
        "copied_from_source": result["copied_from_source"],
        "quantization_config": result["quantization_config"],
        "source_bytes": _dir_bytes(Path(job.input.model)),
        "output_bytes": _dir_bytes(out_dir),
        "output_files": {name: (out_dir / name).stat().st_size for name in manifest},
        "wall_seconds": round(time.monotonic() - started, 1),
        "versions": _versions(),
    })
    print(f"quantized {result['quantized_modules']} modules into {out_dir} "
          f"in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    from common import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
