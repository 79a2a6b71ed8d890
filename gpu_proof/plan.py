"""What a GPU-proof run will do, decided before any GPU time: the catalog's variants, the steps that serve them and
the run's options, each checked against the catalog (`driver.py --plan` prints the steps, no GPU needed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

# --max-resident's default: how many other servers (any driver's) may be resident on the host while a probe runs.
# Measured with --alone on one H200 (docs/results.md's resident-server table): the combined suffix
# variant beside two idle resident servers was no slower than alone on the same server (TTFT 114-121 ms either way,
# ITL 0.40-0.47 ms), where probes beside fifteen resident servers had read +20-33 % inter-token latency.
MAX_RESIDENT = 2


class PlanError(SystemExit):
    """A run that cannot be planned (unknown variant, a drafter with no way to get it): before any step."""


def catalog(config_path: Path):
    """The pipeline's view of a config (lib.dag.config.load: schema defaults filled, sweeps expanded)."""
    import yaml

    from lib.dag import config as pipeline_config

    return pipeline_config.load(yaml.safe_load(Path(config_path).read_text()), ROOT)


def quantizes(recipe: str) -> bool:
    """Whether scripts/quantize.py changes the weights for this recipe (bf16's recipe has no *_stage: a copy)."""
    import yaml

    return any(key.endswith("_stage") for key in yaml.safe_load((ROOT / recipe).read_text()))


def groups(names: list[str], together: int) -> dict[str, list[str]]:
    """The serve steps: `together` variants a group, in the order given."""
    return {f"serve-{i // together + 1}": names[i : i + together] for i in range(0, len(names), together)}


def plan_steps(names: list[str], variants: dict, together: int, random_drafter: bool) -> list[str]:
    """The steps that serve `names` (catalog variants) in their order; each recipe is quantized and the drafter
    made just before the first group that needs them, so the first group serves sooner."""
    unknown = [name for name in names if name not in variants]
    if unknown:
        raise PlanError(f"not in the catalog (config variants and sweeps): {unknown}; known: {sorted(variants)}")
    if not names:
        raise PlanError("no variants given (--variants a,b,c)")
    drafted = [name for name in names if variants[name]["speculative"]["method"] == "dflash"]
    if drafted and not random_drafter:
        fetch = "which this offline host cannot fetch: --random-drafter"
        raise PlanError(f"{drafted} draft with a trained drafter, {fetch}")
    steps = ["environment", "checkpoint", "bandwidth"]
    for group, members in groups(names, together).items():
        for name in members:
            recipe = variants[name]["recipe"]
            if quantizes(recipe) and f"quantize-{Path(recipe).stem}" not in steps:
                steps.append(f"quantize-{Path(recipe).stem}")
            if name in drafted and "drafter" not in steps:
                steps.append("drafter")
        steps.append(group)
    if any(variants[name]["speculative"]["method"] != "none" for name in names):
        steps.append("lossless")
    return steps


def pairs(items: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items)


def from_args(args, pipeline) -> tuple[list[str], list[str], dict]:
    """The variants, their steps and the Driver's options from driver.py's arguments, every name checked."""
    names = [name for name in args.variants.split(",") if name]
    steps = plan_steps(names, pipeline.config["variants"], args.together, args.random_drafter or bool(args.drafter))
    if args.together > args.max_resident + 1:
        resident = f"{args.together - 1} other servers resident beside each probe"
        raise PlanError(f"--together {args.together} keeps {resident}: more than --max-resident {args.max_resident}")
    quantized, reference_for = pairs(args.quantized), pairs(args.reference_for)
    unknown = sorted(set(quantized) - set(pipeline.recipes))
    if unknown:
        raise PlanError(f"--quantized {unknown}: not a recipe of the catalog; known: {sorted(pipeline.recipes)}")
    restart = [name for name in args.restart.split(",") if name]
    alone = [name for name in args.alone.split(",") if name]
    strays = sorted({*reference_for, *reference_for.values(), *restart, *alone} - set(names))
    if strays:
        raise PlanError(f"--reference-for, --restart or --alone {strays}: not among --variants {names}")
    for group, members in groups(names, args.together).items():
        crowded = [name for name in members if name in alone]
        if len(crowded) > 1:
            raise PlanError(f"--alone {crowded} share {group}: once one is probed alone the others are stopped")
        if crowded and len(members) < 2:
            raise PlanError(f"--alone {crowded}: nothing is resident beside it in {group} (--together 2 or more)")
    options = {key: value for key, value in vars(args).items() if key not in ("variants", "state", "plan")}
    options |= {"quantized": quantized, "restart": restart, "reference_for": reference_for, "alone": alone}
    options["serve_env"] = pairs(args.serve_env)
    options["serve_set"] = {key: json.loads(value) for key, value in pairs(args.serve_set).items()}
    options["config"] = str(Path(args.config).resolve().relative_to(ROOT))
    options["engine"] = expected_engine(pipeline, args.engine)
    return names, steps, options


def expected_engine(pipeline, given: str | None) -> str:
    """The vLLM release the bundle must be: --engine's, else the catalog's engine.vllm."""
    return given or pipeline.config["engine"]["vllm"]
