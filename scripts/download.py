"""download: put the model checkpoint in place and record a sha256 manifest of it.

source "hub": snapshot of a pinned commit of the hub repository (real profile). Every file is checked against the
hashes the hub itself lists for that commit (its tree listing: the LFS sha256 of a large file, the git blob sha1 of
a small one) before anything is kept; the hashes go into the record and the manifest is written from the verified
bytes, which later stages check before they read the checkpoint (lib/checkpoint.verify_manifest).
source "synthetic": the tiny, seeded Qwen3.5-architecture model built by lib/tiny (tiny profile), untrained:
train_tiny trains it when model.tiny.train.steps > 0. The checkpoint is assembled in a sibling `.partial`
directory and renamed into place only when complete (lib/checkpoint.py).
"""

from pathlib import Path

from lib.checkpoint import write_checkpoint
from lib.hub import check_revision, fetch_hub
from lib.stage import StageError

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "download.schema.yaml"


def build_synthetic(tiny: dict, corpus: str, dest: Path, generator: str | None = None) -> None:
    """The untrained tiny checkpoint in dest. With the training data generator (the model is to be trained),
    the tokenizer also learns the tasks' fixed wording, as a real tokenizer knows its common words."""
    from lib.tiny.synthesis import build_tiny
    from lib.tiny.training import load_generator

    if not Path(corpus).is_file():
        raise StageError(f"tiny corpus {corpus} not found")
    extra = load_generator(generator).tokenizer_text() if generator else ""
    build_tiny(dest, corpus, seed=int(tiny["seed"]), vocab_size=int(tiny["vocab_size"]), tokenizer_extra=extra)


def main(job) -> None:
    params = job.params
    source = params.source
    if source == "hub":
        repo, revision = params.repo, params.revision
        check_revision(repo, revision)  # fail before touching anything
        fill = lambda tmp: fetch_hub(repo, revision, tmp)  # noqa: E731
    elif source == "synthetic":
        tiny = dict(params.tiny or {})
        corpus = getattr(job.input, "corpus", None) or tiny.get("corpus")
        generator = getattr(job.input, "generator", None) or None
        fill = lambda tmp: build_synthetic(tiny, corpus, tmp, generator)  # noqa: E731
    else:
        raise StageError(f"params.source must be 'hub' or 'synthetic', got {source!r}")
    record = write_checkpoint(job.output, fill, {"source": source, "training": None}, SCHEMA)
    checked = f", each matching the hub's hash at {record['hub']['revision']}" if "hub" in record else ""
    print(f"download: {record['files']} files in {job.output.checkpoint}{checked}")


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__, online=True)
