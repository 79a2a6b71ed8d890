rule base_image:
    """The tiny profile's base: Debian + Python + the CPU serving venv (no registry to pull a base from)."""
    input:
        serve_venv=venv("serve"),  # copied into the image; not a venv to run this script in
        code=code_of("scripts/base_image.py"),
    output:
        image="results/base_image/image.json",
    params:
        suite=config["image"]["base_suite"],
        mirror=config["image"]["base_mirror"],
        packages=config["image"]["base_packages"],
        tag=f"docker.io/library/{config['image']['name']}-base:{config['envs']['serve']}",
        builder=config["image"]["builder"],
        reproducible=config["image"]["reproducible"],  # build_image builds with buildah: copy the base there too
    resources:
        **RESOURCES["base_image"],
    log:
        "logs/base_image/base_image.log",
    benchmark:
        "benchmarks/base_image/base_image.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/base_image.py"


rule pull_base:
    """The real profile's base: image.base from its registry, at the digest its tag's lock entry holds."""
    input:
        lock=LOCK_ENTRIES["base"],  # config/lock/images/<registry>/<repository>/<tag>.yaml (none when pinned)
        code=code_of("scripts/pull_base.py"),
    output:
        image="results/pull_base/image.json",
    params:
        base=config["image"]["base"],
    resources:
        **RESOURCES["pull_base"],
    log:
        "logs/pull_base/pull_base.log",
    benchmark:
        "benchmarks/pull_base/pull_base.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/pull_base.py"


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
