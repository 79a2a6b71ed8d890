rule build_image:
    input:
        base=BASE_RECORD,
        model=quantized("model"),
        draft=draft_input,
        cache=rules.bake_compile_cache.output.cache,
        coldstart=rules.bake_compile_cache.output.coldstart,  # the GPU architecture the cache was baked on
        serve=rules.serve_config.output.serve,
        serving=SERVING_FILES,
        dockerfile="Dockerfile",
        # Hashed into labels only (provenance).
        recipe=lambda wildcards: variant_config(wildcards)["recipe"],
        weights_manifest=SOURCE_MODEL["manifest"],
        quantized_manifest=quantized("manifest.json"),
        draft_manifest=draft_manifest,
        serve_freeze=optional(LOCAL_BASE, venv("serve")),  # the local base's vLLM version; not a venv to run in
        code=code_of("scripts/build_image.py"),
    output:
        image="results/{variant}/build_image/image.json",
    params:
        tag=lambda wildcards: PIPELINE.image_ref(wildcards.variant),
        builder=config["image"]["builder"],
        reproducible=config["image"]["reproducible"],
        base_ref=config["image"]["base"],
        provenance=lambda wildcards: PIPELINE.provenance(wildcards.variant),
        gpu_arch=config["image"]["gpu_arch"],
        allow_arch_mismatch=config["image"]["allow_arch_mismatch"],
    resources:
        **RESOURCES["build_image"],
        image_writes=1,
    log:
        "logs/build_image/{variant}.log",
    benchmark:
        "benchmarks/build_image/{variant}.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/build_image.py"
