"""What a recipe file says, read without llmcompressor or torch: the config's checks read it before any job runs
(lib/dag/config.py: a drafter's vocabulary, what a pruning recipe keeps, which variant is the bf16 reference) and the
quantize stage's guards plan from it (lib/quantize/checks.py)."""

from pathlib import Path

from lib.stage import StageError


def read_recipe(path: str | Path) -> dict:
    """The parts of a recipe the guards need: the architectures it is written for (its own `pipeline:`
    section) and, per config group of each quantizing modifier, targets, ignore and weight args. A recipe
    with no modifiers quantizes nothing (the bf16 baseline)."""
    import yaml

    try:
        recipe = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise StageError(f"cannot read recipe {path}: {error}") from error
    if not isinstance(recipe, dict):
        raise StageError(f"recipe {path} is not a YAML mapping")
    architectures = (recipe.get("pipeline") or {}).get("architectures")
    if not architectures or not isinstance(architectures, list):
        raise StageError(f"recipe {path} has no pipeline.architectures list (the architectures it was written for)")
    modifiers = [
        (name, args or {})
        for key, stage in recipe.items()
        if key.endswith("_stage") and isinstance(stage, dict)
        for group_key, group in stage.items()
        if group_key.endswith("_modifiers") and isinstance(group, dict)
        for name, args in group.items()
    ]
    groups = []
    for name, args in modifiers:
        if "config_groups" not in args:
            if "scheme" in args or "targets" in args:
                raise StageError(
                    f"recipe {path}: {name} uses scheme/targets; spell the scheme out as config_groups "
                    "(targets + weights) so the guards can check it against the checkpoint"
                )
            continue  # a transform such as AWQModifier: it quantizes nothing itself
        for group_name, group in args["config_groups"].items():
            weights = group.get("weights") or {}
            if not isinstance(weights.get("num_bits"), int) or weights.get("strategy") not in ("group", "channel"):
                raise StageError(
                    f"recipe {path}: {name}.{group_name}.weights needs integer num_bits and strategy "
                    f"group or channel, got {weights}"
                )
            if weights["strategy"] == "group" and not (
                isinstance(weights.get("group_size"), int) and weights["group_size"] > 0
            ):
                raise StageError(f"recipe {path}: {name}.{group_name}: strategy group needs a positive group_size")
            groups.append(
                {
                    "modifier": name,
                    "group": group_name,
                    "targets": list(group.get("targets") or []),
                    "ignore": list(args.get("ignore") or []),
                    "weights": weights,
                }
            )
    if modifiers and not groups:
        raise StageError(f"recipe {path} has modifiers but none with config_groups: it would quantize nothing")
    untie_head = (recipe.get("pipeline") or {}).get("untie_head", False)
    if not isinstance(untie_head, bool):
        raise StageError(f"recipe {path}: pipeline.untie_head must be true or false, got {untie_head!r}")
    prune = (recipe.get("pipeline") or {}).get("prune_vocab")
    if prune is not None and not (
        isinstance(prune, dict) and set(prune) == {"size"} and isinstance(prune["size"], int) and prune["size"] > 0
    ):
        raise StageError(
            f"recipe {path}: pipeline.prune_vocab must be {{size: N}} with N a positive integer, got {prune!r}"
        )
    return {
        "path": str(path),
        "architectures": architectures,
        "untie_head": untie_head,
        "prune_vocab": prune,
        "modifiers": [name for name, _ in modifiers],
        "groups": groups,
        "quantize": bool(modifiers),
    }
