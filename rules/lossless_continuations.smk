# A shared lossless reference's continuations past another variant's near ties (see rules/lossless.smk).


rule lossless_continuations:
    """For a variant that reads another variant's reference (Pipeline.reference_source): the reference's greedy
    continuations from this variant's own output past its near ties. Serves the reference's image with speculation
    off only when the check's walk meets such a tie; otherwise writes an empty record without a server."""
    input:
        reference=lambda wildcards: PIPELINE.lossless_reference(wildcards.variant)[0],
        latency="results/{variant}/latency_probe/latency.json",
        image=lambda wildcards: f"results/{PIPELINE.reference_source(wildcards.variant)}/build_image/image.json",
        serve=lambda wildcards: f"results/{PIPELINE.reference_source(wildcards.variant)}/serve_config/serve.json",
        code=code_of("scripts/lossless_continuations.py"),
    output:
        continuations="results/{variant}/lossless/continuations.json",
    params:
        run=PIPELINE.run_settings(),
        model_name=lambda wildcards: variant_config(wildcards)["serve"]["served_model_name"],  # the reference's too
        ignore_eos=config["probe"]["ignore_eos"],  # as the probe asked: the continuation ends where its output does
    resources:
        gpu=GPU,
        **RESOURCES["lossless_continuations"],
        host_share=50,
    log:
        "logs/lossless_continuations/{variant}.log",
    benchmark:
        "benchmarks/lossless_continuations/{variant}.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/lossless_continuations.py"
