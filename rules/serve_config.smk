rule serve_config:
    """The variant's serve.json, as the image's entrypoint reads it at /opt/ml/serve.json: serve settings with
    every default filled in and the speculative section (serving/settings.py). A changed K or serve flag changes
    this file alone upstream of the bake, so the bake and what follows rerun, never quantize."""
    input:
        draft=draft_input,  # a drafted variant's drafter: K must fit its block
        code=code_of("scripts/serve_config.py"),
    output:
        serve="results/{variant}/serve_config/serve.json",
    params:
        serve=lambda wildcards: variant_config(wildcards)["serve"],
        speculative=lambda wildcards: variant_config(wildcards)["speculative"],
    resources:
        **RESOURCES["serve_config"],
    log:
        "logs/serve_config/{variant}.log",
    benchmark:
        "benchmarks/serve_config/{variant}.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/serve_config.py"
