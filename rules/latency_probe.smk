rule latency_probe:
    input:
        image=rules.build_image.output.image,
        schema="schemas/latency.schema.yaml",
        varied_text=config["probe"]["varied_text"],
        code=code_of("scripts/latency_probe.py"),
    output:
        latency=report("results/{variant}/latency_probe/latency.json", category="Latency", labels={"variant": "{variant}", "record": "json"}),
        plot=report("results/{variant}/latency_probe/latency.png", category="Latency", labels={"variant": "{variant}", "record": "plot"}),
    params:
        run=PIPELINE.run_settings(),
        model_name=lambda wildcards: variant_config(wildcards)["serve"]["served_model_name"],
        probe=config["probe"],
        # what the record's ratios are against: the contract's categories (lib.baseline.probe_baseline)
        contract=PIPELINE.contract_categories,
        require_cache_hit=config["image"]["require_cache_hit"],
    resources:
        gpu=GPU,
        **RESOURCES["latency_probe"],
        host_share=100,  # the whole host: nothing else that declares a share runs beside a timing
    log:
        "logs/latency_probe/{variant}.log",
    benchmark:
        "benchmarks/latency_probe/{variant}.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/latency_probe.py"
