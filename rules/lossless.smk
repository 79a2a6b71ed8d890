# Speculation must not change what the model says: a speculative variant's greedy output ids (recorded by its
# latency probe, per prompt set and category) must equal the same settings' without speculation. The reference is
# the cheapest honest one (the same weights, vLLM and serve settings; speculation the only difference):
#   the variant's own built image served once more with speculation off (serve.json mounted over
#   /opt/ml/serve.json), one request per category and set: a server start and ~1/(warmup + runs) of a probe.
#   Compared variants with the same recipe and serve settings (a K sweep) share one: with speculation off they
#   are the same server (Pipeline.reference_source). It
#   records its top logprobs, so a difference at a near tie (bf16 rounding) is told from a real flip; a
#   no-speculation twin's probe cannot tell them apart (measured: MTP K=1 and K=2 both differ from tiny-awq-none at
#   one fresh prompt's token 39, a 0.0625-nat tie). Past a near tie the reference is continued from the variant's
#   own output and the comparison goes on from there: so the reference reads the variant's probe (it runs after it),
#   and a variant reading a shared reference gets rule lossless_continuations (a server only if it has such a tie).
# Besides the prompt sets, the probe's concurrent batch (4 requests at once, recorded untimed after the timed runs) is
# compared the same way.
# A variant without speculation passes trivially. See scripts/lossless.py and scripts/lib/lossless.py; the reference
# is chosen by Pipeline.lossless_reference() in scripts/lib/dag/config.py.


checkpoint lossless:
    """Refuse a variant whose greedy outputs differ from its settings' without speculation (fails naming the set,
    category, first differing position and both ids; for a select candidate, recorded instead). A checkpoint: select's
    walk reads the record to decide whether this candidate's gate runs (rules/select.smk)."""
    input:
        latency=lambda wildcards: (
            f"results/{wildcards.variant}/latency_probe/latency.json" if PIPELINE.speculates(wildcards.variant) else []
        ),
        reference=lambda wildcards: PIPELINE.lossless_reference(wildcards.variant)[0] or [],
        # the reference's continuations past this variant's near ties: in its own reference, or lossless_continuations'
        continuations=lambda wildcards: PIPELINE.lossless_continuations(wildcards.variant) or [],
        schema="schemas/lossless.schema.yaml",
        code=code_of("scripts/lossless.py"),
    output:
        lossless=report("results/{variant}/lossless/lossless.json", category="Lossless", labels={"variant": "{variant}"}),
    params:
        speculative=lambda wildcards: variant_config(wildcards)["speculative"],
        reference_kind=lambda wildcards: PIPELINE.lossless_reference(wildcards.variant)[1],
        # recorded, not fatal, for a select candidate (select skips it and says why; tarball refuses it), in either
        # mode: so the default run and a sweep over it agree, and its record is not redone (nor the image re-saved)
        fatal=lambda wildcards: wildcards.variant not in CANDIDATES,
    resources:
        **RESOURCES["lossless"],
    log:
        "logs/lossless/{variant}.log",
    benchmark:
        "benchmarks/lossless/{variant}.tsv"
    conda:
        "../envs/driver.yaml"
    script:
        "../scripts/lossless.py"
