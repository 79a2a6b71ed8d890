rule verify_image:
    """Re-check the deliverable as it lies on disk, with no daemon, and keep the record (labels, env, layer
    digests); tarball already ran the same check before writing the .sha256. With a Docker daemon
    (image.verify_run), also run the archived image and smoke its endpoints. See scripts/verify_image.py."""
    input:
        tarball=rules.tarball.output.tarball,
        sha256=rules.tarball.output.sha256,
        image=selected_image_record,
        schema="schemas/verify.schema.yaml",
        code=code_of("scripts/verify_image.py"),
    output:
        report=report("results/{variant}/verify_image/verify.json", category="Image", labels={"variant": "{variant}"}),
    params:
        verify_run=config["image"]["verify_run"],
        gpu_arch=config["image"]["gpu_arch"],
        allow_arch_mismatch=config["image"]["allow_arch_mismatch"],
        run=PIPELINE.run_settings(),
        model_name=lambda wildcards: config["variants"][wildcards.variant]["serve"]["served_model_name"],
    resources:
        **RESOURCES["verify_image"],
    log:
        "logs/verify_image/{variant}.log",
    benchmark:
        "benchmarks/verify_image/{variant}.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/verify_image.py"
