rule submit:
    """Upload image.tar.gz to the competition's submission API and submit it; not part of the default target
    (`snakemake submit`). URL, team and key come from the environment (QWEN_SUBMIT_URL, QWEN_SUBMIT_TEAM,
    QWEN_SUBMIT_KEY) at run time only, never from config or params; an interrupted multipart upload resumes from
    image.tar.gz.upload.json on the next run."""
    input:
        tarball="image.tar.gz",
        sha256="image.tar.gz.sha256",
        schema="schemas/submission.schema.yaml",
    output:
        record="results/submission.json",
    params:
        part_size_mb=config["submit"]["part_size_mb"],
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
