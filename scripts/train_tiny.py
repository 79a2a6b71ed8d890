"""train_tiny: the tiny profile's brief training of download's synthesized checkpoint (model.tiny.train), a step
of its own so that changed training settings rerun only this and what follows.

The training starts from the synthesized model's float32 initialisation, made again from the same seed: the
checkpoint holds it rounded to bf16, and training from the rounded weights would give other bytes than the
model that was tuned (config/tiny.yaml's numbers). The parts training leaves alone (tokenizer, configs, the MTP
shard) must come out byte-identical to the synthesized checkpoint's, which proves the initialisation matched.
"""

import json
import shutil
from pathlib import Path

from lib.checkpoint import verify_manifest, write_checkpoint
from lib.stage import StageError, checkpoint_files, sha256_file

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "download.schema.yaml"
# what training rewrites (and the MTP shard when the MTP layer is trained); every other file must equal the
# synthesized checkpoint's
TRAINED_FILES = {"model.safetensors"}
MTP_FILE = "model-mtp.safetensors"


def check_untrained_parts(synthesized: Path, trained: Path, rewritten: set[str] = TRAINED_FILES) -> None:
    differ = [
        path.name
        for path in checkpoint_files(synthesized)
        if path.name not in rewritten
        and (not (trained / path.name).is_file() or sha256_file(trained / path.name) != sha256_file(path))
    ]
    if differ:
        raise StageError(
            f"training rewrote {', '.join(differ)} differently from the synthesized checkpoint "
            f"{synthesized}: its seed or dims are not this rule's (rerun download)"
        )


def train(synthesized: Path, dest: Path, seed: int, settings: dict, generator: str, sentences: list[str] = ()) -> dict:
    """The trained checkpoint in dest; returns the download record's `training` entry."""
    from lib.tiny.synthesis import build_tiny_checkpoint
    from lib.tiny.training import load_generator, training_plan

    plan = training_plan(settings, load_generator(generator), sentences)
    if plan is None:
        raise StageError("model.tiny.train.steps is 0: there is nothing to train (download's checkpoint is final)")
    for path in checkpoint_files(synthesized):
        shutil.copy2(path, dest / path.name)
    result = build_tiny_checkpoint(dest, seed, dest, train=plan)
    check_untrained_parts(synthesized, dest, TRAINED_FILES | ({MTP_FILE} if plan["mtp"] else set()))
    return result["training"]


def main(job) -> None:
    synthesized = Path(job.input.checkpoint)
    verify_manifest(synthesized, job.input.manifest)  # download's checkpoint as it was made, or nothing
    record = json.loads(Path(job.input.record).read_text())
    settings = dict(job.params.train)
    fill = lambda tmp: {
        "training": train(
            synthesized,
            tmp,
            int(job.params.seed),
            settings,
            job.input.generator,  # noqa: E731
            [job.params.sentence],
        )
    }
    record = write_checkpoint(job.output, fill, record, SCHEMA)
    t = record["training"]
    print(
        f"train_tiny: {t['steps']} steps in {t['seconds']} s, loss {t['first_loss']} -> {t['final_loss']}, "
        f"held-out answer-token accuracy {t['heldout_answer_token_accuracy']}"
    )
    if t.get("mtp"):
        m = t["mtp"]
        print(
            f"train_tiny: MTP {m['steps']} steps in {m['seconds']} s, loss {m['first_loss']} -> {m['final_loss']}, "
            "mean acceptance length per K "
            + ", ".join(
                f"{name} " + "/".join(str(row["mean_acceptance_length"]) for row in rows)
                for name, rows in m["acceptance"].items()
            )
        )


if __name__ == "__main__":
    from lib.stage import run_stage

    run_stage(main, globals().get("snakemake"), __file__)
