CALIBRATION_FILE = config["calibration"]["source"] == "text_file"


rule quantize:
    input:
        venv=venv("compress"),
        model=rules.download.output.checkpoint,
        recipe=lambda wildcards: variant_config(wildcards)["recipe"],
        calibration=optional(CALIBRATION_FILE, config["calibration"]["path"]),
    output:
        model=directory("results/{variant}/quantize/model"),
        manifest="results/{variant}/quantize/manifest.json",
        report="results/{variant}/quantize/report.json",
    params:
        calibration=config["calibration"],
    threads: 4  # scaled down to --cores
    log:
        "logs/quantize/{variant}.log",
    benchmark:
        "benchmarks/quantize/{variant}.tsv"
    conda:
        "../envs/compress.yaml"
    script:
        "../scripts/quantize.py"
