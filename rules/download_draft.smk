rule download_draft:
    """A dflash variant's drafter, fetched at its pinned revision and checked against the hub's own hashes as the
    model is (or made locally for the tiny target), then checked to fit the target before anything is built."""
    input:
        venv=venv("compress"),
        target=SOURCE_MODEL["checkpoint"],
        target_manifest=SOURCE_MODEL["manifest"],
        schema="schemas/download.schema.yaml",
        code=code_of("scripts/download_draft.py"),
    output:
        checkpoint=directory("weights/drafts/{draft}/checkpoint"),
        manifest="weights/drafts/{draft}/manifest.json",
        record=report("weights/drafts/{draft}/download.json", category="Download"),
    params:
        source=config["model"]["source"],
        draft=lambda wildcards: DRAFTS[wildcards.draft],
        tiny=config["model"]["tiny"]["drafter"] if SYNTHETIC else None,
    resources:
        **RESOURCES["download_draft"],
    log:
        "logs/download_draft/{draft}.log",
    benchmark:
        "benchmarks/download_draft/{draft}.tsv"
    conda:
        "../envs/compress.yaml"
    script:
        "../scripts/download_draft.py"
