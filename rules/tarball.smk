rule tarball:
    """The deliverable: only an image whose variant passed the quality gate is saved. Its variant is the fixed
    one, or the one the `select` checkpoint chose (results/selection.json)."""
    input:
        image=selected("build_image/image.json"),
        latency=selected("latency_probe/latency.json"),
        quality=selected("quality_gate/quality.json"),
        lossless=selected("lossless/lossless.json"),  # greedy ids equal without speculation (rules/lossless.smk)
        # No results/selection.json input: the functions above already wait for the `select` checkpoint, and a
        # selection that names the image.tar.gz already holds (a sweep after the default run) must not re-save it.
        code=code_of("scripts/tarball.py"),
    output:
        tarball="image.tar.gz",
        sha256="image.tar.gz.sha256",
    params:
        max_size_gb=config["image"]["max_size_gb"],
        compress_level=config["image"]["compress_level"],
    resources:
        **RESOURCES["tarball"],
        host_share=50,
    log:
        "logs/tarball/tarball.log",
    benchmark:
        "benchmarks/tarball/tarball.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/tarball.py"
