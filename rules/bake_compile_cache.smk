rule bake_compile_cache:
    """Serve the quantized model once in the base image, so the compile and kernel caches ship in the image."""
    input:
        base=BASE_RECORD,
        model=quantized("model"),
        draft=draft_input,
        serve=rules.serve_config.output.serve,
        serving=SERVING_FILES,
        schema="schemas/coldstart.schema.yaml",
        code=code_of("scripts/bake_compile_cache.py"),
    output:
        cache="results/{variant}/bake_compile_cache/compile_cache.tar",
        coldstart=report("results/{variant}/bake_compile_cache/coldstart.json", category="Cold start", labels={"variant": "{variant}"}),
    params:
        base_ref=config["image"]["base"],
        run=PIPELINE.run_settings(),
        categories=config["probe"]["categories"],
        sentence=config["probe"]["sentence"],
    resources:
        gpu=GPU,
        **RESOURCES["bake_compile_cache"],
        host_share=50,
    log:
        "logs/bake_compile_cache/{variant}.log",
    benchmark:
        "benchmarks/bake_compile_cache/{variant}.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/bake_compile_cache.py"
