CALIBRATION_FILE = config["calibration"]["source"] == "text_file"


rule quantize:
    """The variant's recipe on the source checkpoint (a recipe without modifiers copies it: the bf16 baseline),
    with guards before and after; see scripts/quantize.py."""
    input:
        venv=venv("compress"),
        model=rules.download.output.checkpoint,
        recipe=lambda wildcards: variant_config(wildcards)["recipe"],
        calibration=optional(CALIBRATION_FILE, config["calibration"]["path"]),
        heldout=config["quantize"]["heldout"],
        schema="schemas/quantize_report.schema.yaml",
    output:
        model=directory("results/{variant}/quantize/model"),
        manifest="results/{variant}/quantize/manifest.json",
        report=report("results/{variant}/quantize/report.json", category="Quantization", labels={"variant": "{variant}"}),
    params:
        calibration=config["calibration"],
        quantize={k: v for k, v in config["quantize"].items() if k != "heldout"},
    threads: 4  # scaled down to --cores
    log:
        "logs/quantize/{variant}.log",
    benchmark:
        "benchmarks/quantize/{variant}.tsv"
    conda:
        "../envs/compress.yaml"
    script:
        "../scripts/quantize.py"
