# The hub datasets later stages read, fetched once per use at pinned commits; quantize and quality_gate then read
# them with the hub off. A gate dataset's new pin refetches only the gate's cache, never the calibration set.
HUB_CALIBRATION = config["calibration"]["source"] == "hf_dataset"
FETCHED_DATASETS = {
    reader: {"cache": f"datasets/{reader}/cache", "manifest": f"datasets/{reader}/manifest.json"}
    for reader in ("calibration", "gate")
}


rule download_datasets:
    input:
        venv=venv("eval"),  # lm-eval resolves the gate's tasks to the datasets they load
        tasks=lambda wildcards: project_files(TASKS_DIR) if TASKS_DIR and wildcards.use == "gate" else [],
        schema="schemas/datasets.schema.yaml",
        lock=lambda wildcards: LOCK_ENTRIES[wildcards.use],  # the datasets' lock entries (config/lock/datasets/)
        code=code_of("scripts/download_datasets.py"),
    output:
        cache=directory("datasets/{use}/cache"),
        manifest="datasets/{use}/manifest.json",
        record=report("datasets/{use}/datasets.json", category="Download", labels={"datasets": "{use}"}),
    wildcard_constraints:
        use="calibration|gate",
    params:
        calibration=lambda wildcards: (
            {key: config["calibration"][key] for key in ("dataset", "split", "revision")}
            if wildcards.use == "calibration"
            else None
        ),
        tasks=lambda wildcards: config["quality"]["tasks"] if wildcards.use == "gate" else None,
        pins=lambda wildcards: config["quality"]["datasets"] if wildcards.use == "gate" else None,
        tasks_dir=lambda wildcards, input: os.path.commonpath(input.tasks) if input.tasks else None,
    resources:
        **RESOURCES["download_datasets"],
    log:
        "logs/download_datasets/{use}.log",
    benchmark:
        "benchmarks/download_datasets/{use}.tsv"
    conda:
        "../envs/eval.yaml"
    script:
        "../scripts/download_datasets.py"
