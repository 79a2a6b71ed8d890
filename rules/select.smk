# select.mode fastest: every candidate (select.candidates) is probed, ranked by speed (rules/rank_candidates.smk),
# and checked fastest first, its lossless check and then its quality gate, until one passes both; that one is
# image.tar.gz. The gate (hours on the real model) runs for the winner and for faster candidates that failed, never
# for a slower one. The walk is Snakemake's: `select`'s inputs read each visited record through a checkpoint's
# .get(), which raises until that check has run, so Snakemake runs the checks one candidate after the other
# (scripts/lib/dag/selection.py).


def read_json(path):
    return json.loads(Path(path).read_text())


def select_walk():
    """{variant: {"lossless": path, "quality": path (only where the gate ran)}} for each candidate the walk visits,
    fastest first, up to the first that passes both checks. Raises IncompleteCheckpointException at the first record
    that does not exist yet: Snakemake runs that check and asks again."""
    visited = {}

    def record(checkpoint, kind):
        def read(variant):
            path = checkpoint.get(variant=variant).output[0]
            visited.setdefault(variant, {})[kind] = path
            return read_json(path)

        return read

    ranking = read_json(checkpoints.rank_candidates.get().output.ranking)
    selection.walk(
        selection.order(ranking), record(checkpoints.lossless, "lossless"), record(checkpoints.quality_gate, "quality")
    )
    return visited


def select_inputs(wildcards):
    visited = select_walk()
    return {
        "ranking": checkpoints.rank_candidates.get().output.ranking,
        "lossless": [paths["lossless"] for paths in visited.values()],
        "quality": [paths["quality"] for paths in visited.values() if "quality" in paths],
    }


checkpoint select:
    """The variant image.tar.gz is made of (select.mode fastest): the fastest candidate that passes the lossless
    check and the quality gate, each candidate's outcome and the reason in results/selection.json. A checkpoint:
    tarball's inputs are known only once this has chosen."""
    input:
        unpack(select_inputs),
        schema="schemas/selection.schema.yaml",
        code=code_of("scripts/select_variant.py"),
    output:
        selection=report("results/selection.json", category="Selection"),
    params:
        # [variant, gated] in the walk's order: which record of the inputs is whose
        visited=lambda wildcards: [[name, "quality" in paths] for name, paths in select_walk().items()],
    resources:
        **RESOURCES["select"],
    log:
        "logs/select/select.log",
    benchmark:
        "benchmarks/select/select.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/select_variant.py"
