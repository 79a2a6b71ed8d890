

rule download:
    input:
        venv=venv("compress"),
        corpus=optional(SYNTHETIC, config["model"]["tiny"]["corpus"]),
        **(tiny_training_inputs() if TRAINED else {}),
        schema="schemas/download.schema.yaml",
    output:
        checkpoint=directory(f"{MODEL_DIR}/checkpoint"),
        manifest=f"{MODEL_DIR}/manifest.json",
        record=report(f"{MODEL_DIR}/download.json", category="Download"),
    params:
        source=config["model"]["source"],
        repo=config["model"]["repo"],
        revision=config["model"]["revision"],
        # Only the synthetic checkpoint depends on these; keep them out of the real profile's rerun triggers.
        tiny=config["model"]["tiny"] if SYNTHETIC else None,
    threads: 2  # the tiny model's training (model.tiny.train.threads fixes torch's count, for determinism)
    resources:
        mem_mb=16000,
        runtime=60,
    log:
        "logs/download/download.log",
    conda:
        "../envs/compress.yaml"
    script:
        "../scripts/download.py"
