rule verify_image:
    """Re-check the deliverable as it lies on disk, with no daemon, and keep the record (labels, env, layer
    digests); tarball already ran the same check before writing the .sha256. With a Docker daemon
    (image.verify_run), also run the archived image and smoke its endpoints. See scripts/verify_image.py."""
    input:
        tarball=rules.tarball.output.tarball,
        sha256=rules.tarball.output.sha256,
        image=rules.tarball.input.image,
        schema="schemas/verify.schema.yaml",
    output:
        report=report(f"results/{config['variant']}/verify_image/verify.json", category="Image",
                      labels={"variant": config["variant"]}),
    params:
        verify_run=config["image"]["verify_run"],
        run=run_settings(),
        model_name=config["variants"][config["variant"]]["serve"]["served_model_name"],
    log:
        "logs/verify_image/verify_image.log",
    benchmark:
        "benchmarks/verify_image/verify_image.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/verify_image.py"
