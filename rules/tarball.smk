rule tarball:
    """The deliverable: only an image whose variant passed the quality gate is saved."""
    input:
        image=f"results/{config['variant']}/build_image/image.json",
        latency=f"results/{config['variant']}/latency_probe/latency.json",
        quality=f"results/{config['variant']}/quality_gate/quality.json",
    output:
        tarball="image.tar.gz",
        sha256="image.tar.gz.sha256",
    params:
        max_size_gb=config["image"]["max_size_gb"],
        compress_level=config["image"]["compress_level"],
    log:
        "logs/tarball/tarball.log",
    benchmark:
        "benchmarks/tarball/tarball.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/tarball.py"
