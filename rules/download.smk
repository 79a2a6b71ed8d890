# The source checkpoint later stages read. A tiny model that is trained is download's untrained one, moved
# aside to untrained/, trained by train_tiny into these paths.
SOURCE_MODEL = {"checkpoint": f"{MODEL_DIR}/checkpoint", "manifest": f"{MODEL_DIR}/manifest.json",
                "record": f"{MODEL_DIR}/download.json"}
DOWNLOAD_DIR = f"{MODEL_DIR}/untrained" if TRAINED else MODEL_DIR


rule download:
    input:
        venv=venv("compress"),
        corpus=optional(SYNTHETIC, config["model"]["tiny"]["corpus"]),
        # a tokenizer for a model that is trained also learns the tasks' wording
        **({"generator": TINY_TRAIN["generator"]} if TRAINED else {}),
        schema="schemas/download.schema.yaml",
        code=code_of("scripts/download.py"),
    output:
        checkpoint=directory(f"{DOWNLOAD_DIR}/checkpoint"),
        manifest=f"{DOWNLOAD_DIR}/manifest.json",
        record=report(f"{DOWNLOAD_DIR}/download.json", category="Download"),
    params:
        source=config["model"]["source"],
        repo=config["model"]["repo"],
        revision=config["model"]["revision"],
        # Only the synthetic checkpoint depends on these; keep them out of the real profile's rerun triggers,
        # and the training settings out of download's (train_tiny has them).
        tiny={key: config["model"]["tiny"][key] for key in ("seed", "vocab_size")} if SYNTHETIC else None,
    resources:
        **RESOURCES["download"],
    log:
        "logs/download/download.log",
    benchmark:
        "benchmarks/download/download.tsv"
    conda:
        "../envs/compress.yaml"
    script:
        "../scripts/download.py"
