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
