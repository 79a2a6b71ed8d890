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
