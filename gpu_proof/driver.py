"""The GPU proof: variants of the pipeline's own catalog (config.yaml's `variants` and `sweeps`), served on a GPU
host without Docker by the image's entrypoint (`python3 -m serving`) and timed by the pipeline's probe.

    python3 gpu_proof/driver.py --variants bf16,awq-w4a16-g32-none,awq-w4a16-g32-mtp2 [--plan] [--state /tmp/gp]

Steps (gpu_proof/steps.py): `environment` (GPU, CPU, versions), `checkpoint` (a full-size random checkpoint of
Qwen3.5-4B's shapes, gpu_proof/build_checkpoint.py), `bandwidth`, `quantize-<recipe>` (scripts/quantize.py with the
job the rule writes), `drafter` (a random drafter of the real one's shapes), `serve-<n>` (a group of --together
variants: started at once, probed one at a time) and `lossless` (each speculative variant's greedy ids against the
run's no-speculation variant of its recipe, scripts/lib/lossless.py). A variant the catalog does not define is refused
before any step (gpu_proof/plan.py). gpu_proof/collect.py turns STATE/results.tar.gz into the committed records.
docs/gpu-proof.md's table says what each option changes and why.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plan import MAX_RESIDENT, ROOT, catalog, from_args
from steps import Driver


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", required=True, help="catalog variants, comma-separated, in the order to run")
    parser.add_argument("--config", default=str(ROOT / "config.yaml"))
    parser.add_argument("--state", default="/tmp/gp")
    parser.add_argument("--together", type=int, default=1)
    parser.add_argument("--max-resident", type=int, default=MAX_RESIDENT, metavar="N", help="others beside a probe")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--random-drafter", action="store_true")
    parser.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--checkpoint", default=None, metavar="DIR")
    parser.add_argument("--quantized", action="append", default=[], metavar="RECIPE=DIR")
    parser.add_argument("--patches", choices=("catalog", "off"), default="catalog")
    parser.add_argument("--engine", default=None, metavar="X.Y.Z")
    parser.add_argument("--drafter", default=None, metavar="DIR")
    parser.add_argument("--share-state", default=None, metavar="DIR")
    parser.add_argument("--gpu-share", type=float, default=None, metavar="F")
    parser.add_argument("--kv-cache-gib", type=int, default=None, metavar="G")
    parser.add_argument("--serve-set", action="append", default=[], metavar="KEY=JSON")
    parser.add_argument("--restart", default="", metavar="VARIANT,VARIANT")
    parser.add_argument("--alone", default="", metavar="VARIANT,VARIANT", help="probed again with its group stopped")
    parser.add_argument("--reference-for", action="append", default=[], metavar="VARIANT=REFERENCE")
    parser.add_argument("--plan", action="store_true", help="print the steps and exit (no GPU needed)")
    args = parser.parse_args(argv)
    pipeline = catalog(Path(args.config))
    names, steps, options = from_args(args, pipeline)
    if args.plan:
        print("\n".join(steps))
        return
    Driver(Path(args.state), names, pipeline, options).run()


if __name__ == "__main__":
    main()
