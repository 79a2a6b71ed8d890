checkpoint select:
    """The variant image.tar.gz is made of (select.mode fastest): the fastest compared variant that passes every
    gate. A checkpoint: tarball's inputs are known only once this has read the measurements."""
    input:
        summary=rules.compare.output.json,
        # in COMPARED order: a variant whose greedy ids differ without speculation is skipped (rules/lossless.smk)
        lossless=expand("results/{variant}/lossless/lossless.json", variant=COMPARED),
        schema="schemas/selection.schema.yaml",
    output:
        selection=report("results/selection.json", category="Selection"),
    params:
        by=config["select"]["by"],
    resources:
        **RESOURCES["select"],
    log:
        "logs/select/select.log",
    benchmark:
        "benchmarks/select/select.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/select_variant.py"
