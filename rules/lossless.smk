# Speculation must not change what the model says: a speculative variant's greedy output ids (recorded by its
# latency probe, per prompt set and category) must equal the same settings' without speculation. The reference is
# the cheapest honest one (the same weights, vLLM and serve settings; speculation the only difference):
#   - a compared twin variant (same recipe and serve, method none), whose probe runs anyway: no extra cost;
#   - else the variant's own built image served once more with speculation off (serve.json mounted over
#     /opt/ml/serve.json), one request per category and set: a server start and ~1/(warmup + runs) of a probe.
# A variant without speculation passes trivially. See scripts/lossless.py and scripts/lib/lossless.py; the reference
# is chosen by lossless_reference() in rules/common.smk.


rule lossless_reference:
    """The variant's own image with speculation off: the probe's prompts, the first timed run's request each."""
    input:
        image=rules.build_image.output.image,
        serve=rules.serve_config.output.serve,
        varied_text=config["probe"]["varied_text"],
        # Not read: it orders the reference after the probe, so the probe has the machine to itself.
        after_probe=rules.latency_probe.output.latency,
    output:
        reference="results/{variant}/lossless/reference.json",
    params:
        run=PIPELINE.run_settings(),
        model_name=lambda wildcards: variant_config(wildcards)["serve"]["served_model_name"],
        probe=config["probe"],
    resources:
        gpu=GPU,
        mem_mb=32000,
        runtime=60,
        host_share=50,
    log:
        "logs/lossless_reference/{variant}.log",
    benchmark:
        "benchmarks/lossless_reference/{variant}.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/lossless_reference.py"


rule lossless:
    """Refuse a variant whose greedy outputs differ from its settings' without speculation (fails naming the set,
    category, first differing position and both ids; for a variant select chooses among, recorded instead)."""
    input:
        latency=lambda wildcards: (
            f"results/{wildcards.variant}/latency_probe/latency.json" if PIPELINE.speculates(wildcards.variant) else []
        ),
        reference=lossless_reference,
        schema="schemas/lossless.schema.yaml",
    output:
        lossless=report("results/{variant}/lossless/lossless.json", category="Lossless", labels={"variant": "{variant}"}),
    params:
        speculative=lambda wildcards: variant_config(wildcards)["speculative"],
        reference_kind=lossless_reference_kind,
        # recorded, not fatal, where select chooses among compared variants (it skips this one and says why)
        fatal=lambda wildcards: FIXED or wildcards.variant not in COMPARED,
    resources:
        mem_mb=500,
        runtime=5,
    log:
        "logs/lossless/{variant}.log",
    benchmark:
        "benchmarks/lossless/{variant}.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/lossless.py"
