rule submit:
    """Submit image.tar.gz through the competition's API; not part of the default target (`snakemake submit`).
    URL, team and key come from the environment (QWEN_SUBMIT_URL, QWEN_SUBMIT_TEAM, QWEN_SUBMIT_KEY) at run time
    only, never from config or params. The archive's variant's verify, quality and lossless records are inputs: the
    script refuses an image that did not pass them. An interrupted upload resumes from image.tar.gz.upload.json."""
    input:
        tarball=rules.tarball.output.tarball,
        sha256=rules.tarball.output.sha256,
        verify=selected("verify_image/verify.json"),
        quality=selected("quality_gate/quality.json"),
        lossless=selected("lossless/lossless.json"),
        schema="schemas/submission.schema.yaml",
        code=code_of("scripts/submit.py"),
    output:
        record="results/submission.json",
    params:
        retries=config["submit"]["retries"],
        retry_wait_s=config["submit"]["retry_wait_s"],
        timeout_s=config["submit"]["timeout_s"],
    resources:
        **RESOURCES["submit"],
    log:
        "logs/submit/submit.log",
    benchmark:
        "benchmarks/submit/submit.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/submit.py"
