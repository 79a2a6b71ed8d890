# The lossless check's reference: the variant's own image with speculation off (see rules/lossless.smk).


rule lossless_reference:
    """The variant's own image with speculation off (the reference of every compared variant with its recipe and
    serve settings): the probe's prompts, the first timed run's request each, the probe's concurrent batch, then the
    greedy continuations from this variant's own output past its near ties."""
    input:
        image=rules.build_image.output.image,
        serve=rules.serve_config.output.serve,
        varied_text=config["probe"]["varied_text"],
        # Read: the speculative ids to continue from after a near tie. Also orders the reference after the probe, so
        # the probe has the machine to itself.
        latency=rules.latency_probe.output.latency,
        code=code_of("scripts/lossless_reference.py"),
    output:
        reference="results/{variant}/lossless/reference.json",
    params:
        run=PIPELINE.run_settings(),
        model_name=lambda wildcards: variant_config(wildcards)["serve"]["served_model_name"],
        probe=config["probe"],
    resources:
        gpu=GPU,
        **RESOURCES["lossless_reference"],
        host_share=50,
    log:
        "logs/lossless_reference/{variant}.log",
    benchmark:
        "benchmarks/lossless_reference/{variant}.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/lossless_reference.py"

