CALIBRATION_FILE = config["calibration"]["source"] == "text_file"


rule quantize:
    """A recipe on the source checkpoint (a recipe without modifiers copies it: the bf16 baseline), with guards
    before and after; see scripts/quantize.py. Keyed by recipe, not variant: variants that differ only in
    serving or speculation (a K sweep) share one checkpoint."""
    input:
        venv=venv("compress"),
        model=SOURCE_MODEL["checkpoint"],
        model_manifest=SOURCE_MODEL["manifest"],  # checked before the model is read (a rerun trusts nothing changed)
        recipe=lambda wildcards: RECIPES[wildcards.recipe],
        calibration=optional(CALIBRATION_FILE, config["calibration"]["path"]),
        # a hub calibration set, fetched once at its pinned commit (rules/download_datasets.smk); read with the hub off
        calibration_cache=optional(HUB_CALIBRATION, FETCHED_DATASETS["calibration"]["cache"]),
        calibration_datasets=optional(HUB_CALIBRATION, FETCHED_DATASETS["calibration"]["manifest"]),
        heldout=config["quantize"]["heldout"],
        keep_texts=lambda wildcards: PIPELINE.vocab_keep(wildcards.recipe)["files"],
        schema="schemas/quantize_report.schema.yaml",
        code=code_of("scripts/quantize.py"),
    output:
        model=directory("results/quantize/{recipe}/model"),
        manifest="results/quantize/{recipe}/manifest.json",
        report=report("results/quantize/{recipe}/report.json", category="Quantization", labels={"recipe": "{recipe}"}),
    params:
        calibration=config["calibration"],
        quantize={k: v for k, v in config["quantize"].items() if k != "heldout"},
        keep_sentence=lambda wildcards: PIPELINE.vocab_keep(wildcards.recipe)["sentence"],
    threads: 4  # scaled down to --cores
    resources:
        gpu=GPU,
        **RESOURCES["quantize"],
        host_share=50,
    log:
        "logs/quantize/{recipe}.log",
    benchmark:
        "benchmarks/quantize/{recipe}.tsv"
    conda:
        "../envs/compress.yaml"
    script:
        "../scripts/quantize.py"
