checkpoint rank_candidates:
    """Every candidate fastest first by select.by on the competition's prompts (fresh-prompt speed beside it): the
    order `select` checks them in."""
    input:
        latency=expand("results/{variant}/latency_probe/latency.json", variant=CANDIDATES),
        # the run's same-host bf16 variant, when it measures one: mean speedups are against its medians
        bf16_reference=[f"results/{BF16_REFERENCE}/latency_probe/latency.json"] if BF16_REFERENCE else [],
        schema="schemas/ranking.schema.yaml",
        code=code_of("scripts/rank_candidates.py"),
    output:
        ranking=report("results/ranking.json", category="Selection"),
    params:
        candidates=CANDIDATES,  # in the order of the latency inputs
        by=config["select"]["by"],
        bf16_reference=BF16_REFERENCE,
    resources:
        **RESOURCES["rank_candidates"],
    log:
        "logs/rank_candidates/rank_candidates.log",
    benchmark:
        "benchmarks/rank_candidates/rank_candidates.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/rank_candidates.py"
