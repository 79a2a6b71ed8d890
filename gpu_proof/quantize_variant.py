"""Run the project's quantize stage (scripts/quantize.py, llmcompressor on CUDA) on the full-size checkpoint,
with the job the Snakemake rule would give it, and record its time and peak GPU memory. The stage runs as a
program (`quantize.py --job`), in this process so that torch's peak-memory counters see it.

    PYTHONPATH=<llmcompressor bundle> python3 gpu_proof/quantize_variant.py MODEL_DIR RECIPE OUT_DIR RESULT_JSON

Calibration is the repository's own text (data/tiny/corpus.txt, as chat turns, with config.yaml's
max_seq_length and seed, 32 samples as the tiny profile: AWQ grid-searches every layer over every sample, and the
proof has minutes of GPU time): the host is offline, so the real profile's hub dataset is out of
reach. The held-out bounds are opened up (agreement >= 0, ratio <= 1e6): on random weights the real
profile's 0.9 / 1.1 say nothing; the measured agreement and perplexity ratio are recorded as they are.
"""

import json
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # the stage's `lib` imports

from lib.schema import section_defaults  # noqa: E402

CALIBRATION = {
    **section_defaults("calibration"),
    "source": "text_file",
    "path": str(ROOT / "data" / "tiny" / "corpus.txt"),
    "num_samples": 32,
    "max_seq_length": 512,
    "seed": 42,
    "chat": True,
}
# The rule passes config.yaml's quantize section (its held-out file as an input): the schema's defaults for the
# rest (heldout_tokens), with the bounds opened up as above.
BOUNDS = {
    **section_defaults("quantize"),
    "min_top1_agreement": 0.0,
    "max_ppl_ratio": 1.0e6,
}
BOUNDS.pop("heldout", None)


def main() -> None:
    model_dir, recipe, out_dir, result_path = sys.argv[1:5]
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the rule's input: download's manifest, which quantize checks the checkpoint against before reading it
    from lib.stage import write_manifest

    source_manifest = out / "source-manifest.json"
    write_manifest(model_dir, source_manifest)
    job = {
        "rule": "quantize",
        "threads": 16,
        "log": [],
        "wildcards": {"recipe": Path(recipe).stem},
        "input": {
            "model": model_dir,
            "model_manifest": str(source_manifest),
            "recipe": recipe,
            "calibration": CALIBRATION["path"],
            "heldout": str(ROOT / "data" / "heldout.txt"),
            "keep_texts": [],  # pruning recipes keep what the calibration and held-out texts use
            "schema": str(ROOT / "schemas" / "quantize_report.schema.yaml"),
        },
        "output": {
            "model": str(out / "model"),
            "manifest": str(out / "manifest.json"),
            "report": str(out / "report.json"),
        },
        "params": {"calibration": dict(CALIBRATION), "quantize": dict(BOUNDS), "keep_sentence": None},
    }
    job_path = out / "job.json"
    job_path.write_text(json.dumps(job, indent=2) + "\n")
    torch.cuda.reset_peak_memory_stats()
    started = time.monotonic()
    status, error = "ok", None
    try:
        sys.argv = [str(ROOT / "scripts" / "quantize.py"), "--job", str(job_path)]
        runpy.run_path(sys.argv[0], run_name="__main__")
    except BaseException as exc:  # recorded, then re-raised so the exit code says it failed
        status, error = "failed", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        wall = time.monotonic() - started
        report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else None
        result = {
            "kind": "quantize",
            "status": status,
            "error": error,
            "recipe": str(Path(recipe).relative_to(ROOT)) if Path(recipe).is_relative_to(ROOT) else recipe,
            "device": torch.cuda.get_device_name(0),
            "command": "scripts/quantize.py --job job.json (gpu_proof/quantize_variant.py writes the job the "
            "Snakemake rule would pass)",
            "calibration": CALIBRATION | {"path": "data/tiny/corpus.txt"},
            "bounds": BOUNDS,
            "wall_s": round(wall, 1),
            "peak_gpu_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "peak_gpu_memory_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
            "report": report,
        }
        Path(result_path).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
