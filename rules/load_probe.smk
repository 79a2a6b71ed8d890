rule load_probe:
    """The shipped image under concurrent load: valid and invalid requests over the four endpoints, load.concurrency
    at a time; fails naming each request answered wrongly, any 5xx, or a server that does not survive it. See
    scripts/load_probe.py and scripts/lib/load_probe/load.py."""
    input:
        image=rules.build_image.output.image,
        serve=rules.serve_config.output.serve,  # the limits the invalid requests cross
        schema="schemas/load.schema.yaml",
        # Not read: it orders the load after the probe, so the probe has the machine to itself.
        after_probe=rules.latency_probe.output.latency,
        code=code_of("scripts/load_probe.py"),
    output:
        load=report("results/{variant}/load_probe/load.json", category="Load", labels={"variant": "{variant}"}),
    params:
        run=PIPELINE.run_settings(),
        model_name=lambda wildcards: variant_config(wildcards)["serve"]["served_model_name"],
        load=config["load"],
    resources:
        gpu=GPU,
        **RESOURCES["load_probe"],
        host_share=50,
    log:
        "logs/load_probe/{variant}.log",
    benchmark:
        "benchmarks/load_probe/{variant}.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/load_probe.py"
