rule latency_probe:
    input:
        image=rules.build_image.output.image,
        schema="schemas/latency.schema.yaml",
        varied_text=config["probe"]["varied_text"],
    output:
        latency=report("results/{variant}/latency_probe/latency.json", category="Latency", labels={"variant": "{variant}"}),
    params:
        run=run_settings(),
        model_name=lambda wildcards: variant_config(wildcards)["serve"]["served_model_name"],
        probe=config["probe"],
    log:
        "logs/latency_probe/{variant}.log",
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/latency_probe.py"
