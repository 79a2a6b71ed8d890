def selected_image_record(wildcards):
    """The build record of the variant in image.tar.gz; any other variant's verify.json is refused."""
    if wildcards.variant != selected_variant():
        raise WorkflowError(f"image.tar.gz holds variant {selected_variant()!r}, not {wildcards.variant!r}: "
                            f"ask for results/{selected_variant()}/verify_image/verify.json")
    return f"results/{wildcards.variant}/build_image/image.json"


rule verify_image:
    """Re-check the deliverable as it lies on disk, with no daemon, and keep the record (labels, env, layer
    digests). tarball already ran the same check before writing the .sha256; see scripts/verify_image.py."""
    input:
        tarball=rules.tarball.output.tarball,
        sha256=rules.tarball.output.sha256,
        image=selected_image_record,
    output:
        report="results/{variant}/verify_image/verify.json",
    resources:
        mem_mb=8000,
        runtime=30,
    log:
        "logs/verify_image/{variant}.log",
    benchmark:
        "benchmarks/verify_image/{variant}.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/verify_image.py"
