SYNTHETIC = config["model"]["source"] == "synthetic"


rule download:
    input:
        venv=venv("compress"),
        corpus=optional(SYNTHETIC, config["model"]["tiny"]["corpus"]),
    output:
        checkpoint=directory(f"{MODEL_DIR}/checkpoint"),
        manifest=f"{MODEL_DIR}/manifest.json",
    params:
        source=config["model"]["source"],
        repo=config["model"]["repo"],
        revision=config["model"]["revision"],
        # Only the synthetic checkpoint depends on these; keep them out of the real profile's rerun triggers.
        tiny=config["model"]["tiny"] if SYNTHETIC else None,
    resources:
        mem_mb=16000,
        runtime=60,
    log:
        "logs/download/download.log",
    conda:
        "../envs/compress.yaml"
    script:
        "../scripts/download.py"
