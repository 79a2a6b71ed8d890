checkpoint quality_gate:
    """lm-eval against the image's server; a failing gate is recorded (passed: false), not fatal: select moves
    on to the next candidate and tarball refuses it. A checkpoint: select's walk reads the verdict
    (rules/select.smk)."""
    input:
        venv=venv("eval"),
        image=rules.build_image.output.image,
        # Not read: it orders the gate after the probe, so the probe has the machine to itself.
        after_probe=rules.latency_probe.output.latency,
        schema="schemas/quality.schema.yaml",
        tasks=project_files(TASKS_DIR) if TASKS_DIR else [],
        # every hub dataset the tasks load, fetched once at its pinned commit; the gate runs with the hub off
        datasets_cache=FETCHED_DATASETS["gate"]["cache"],
        datasets_manifest=FETCHED_DATASETS["gate"]["manifest"],
        code=code_of("scripts/quality_gate.py"),
    output:
        scores=report("results/{variant}/quality_gate/quality.json", category="Quality gate", labels={"variant": "{variant}"}),
    params:
        model_name=lambda wildcards: variant_config(wildcards)["serve"]["served_model_name"],
        tasks=config["quality"]["tasks"],
        limit=config["quality"]["limit"],
        margin_stderr=config["quality"]["margin_stderr"],
        reference_variant=REFERENCE_VARIANT,
        # A param, not an input: recovery is reported, never gated, and an input would rerun every gate of a
        # sweep once the reference variant's own gate finishes later.
        reference_scores=reference_scores,
        num_concurrent=config["quality"]["num_concurrent"],
        tasks_dir=lambda wildcards, input: os.path.commonpath(input.tasks) if input.tasks else None,
        gpus=config["image"]["gpus"],
        shm_size=config["image"]["shm_size"],
        ping_timeout_s=config["image"]["ping_timeout_s"],
    resources:
        gpu=GPU,
        **RESOURCES["quality_gate"],
        host_share=50,
    log:
        "logs/quality_gate/{variant}.log",
    benchmark:
        "benchmarks/quality_gate/{variant}.tsv"
    conda:
        "../envs/eval.yaml"
    script:
        "../scripts/quality_gate.py"
