rule compare:
    """Every compared variant's latency and quality records in one table (results/summary.*) and three plots:
    speedup against each quality score (Pareto front marked), latency per category, and K sweeps."""
    input:
        latency=expand("results/{variant}/latency_probe/latency.json", variant=COMPARED),
        quality=expand("results/{variant}/quality_gate/quality.json", variant=COMPARED),
        quantize=sorted({f"results/quantize/{recipe_key(name)}/report.json" for name in COMPARED}),
        # a drafted variant's drafter record (its bytes are read every step)
        drafts=sorted({f"weights/drafts/{d}/download.json" for d in map(PIPELINE.draft_folder, COMPARED) if d}),
        schema="schemas/summary.schema.yaml",
        code=code_of("scripts/compare.py"),
    output:
        json=report("results/summary.json", category="Comparison", labels={"record": "summary.json"}),
        csv=report("results/summary.csv", category="Comparison", labels={"record": "summary.csv"}),
        md=report("results/summary.md", category="Comparison", labels={"record": "summary.md"}),
        speedup_vs_quality=report("results/plots/speedup_vs_quality.png", category="Comparison", labels={"record": "speedup vs quality"}),
        latency_per_category=report("results/plots/latency_per_category.png", category="Comparison", labels={"record": "latency per category"}),
        k_sweep=report("results/plots/k_sweep.png", category="Comparison", labels={"record": "K sweep"}),
    params:
        # In COMPARED order; the script pairs them with the input lists by position.
        variants=[
            dict(name=name, recipe_key=recipe_key(name), draft_folder=PIPELINE.draft_folder(name), **config["variants"][name])
            for name in COMPARED
        ],
        reference=config["compare"]["reference"],
    resources:
        **RESOURCES["compare"],
    log:
        "logs/compare/compare.log",
    benchmark:
        "benchmarks/compare/compare.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/compare.py"

