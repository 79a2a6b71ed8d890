"""Sweeps: declared axes over a catalog variant, expanded into named variants (read by scripts/lib/dag/config.py).

A sweep names a `base` variant of the catalog and `axes` (`recipe`, `serve.<key>`, `speculative.<key>`), each
a list of values or a mapping label -> value. Every combination becomes a variant named
`<prefix>-<label>-<label>...` (prefix: the sweep's name unless set), e.g. `tiny-awq-mtp2`. Labels explain the
value: a recipe's file stem, `<method><K>` for K (`mtp2`, `suffix20`: the catalog's names give K so too, and
lib/dag/config.py checks every name's against its settings), `seqs<n>` for max_num_seqs; a mapping names them itself.

A point whose settings (schema defaults filled) equal a catalog variant's, or an earlier point's, IS that
variant: its results are reused, not rebuilt. A point named like a catalog variant with other settings is an
error, never a silent override.
"""

import copy
import itertools
import json
import re
from pathlib import Path
from typing import Callable

NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
SECTIONS = ("serve", "speculative")
# Short labels for list axes whose value alone would not say what was swept (K: k_label).
PREFIXES = {
    "serve.max_num_seqs": "seqs",
    "serve.max_num_batched_tokens": "batch",
    "serve.max_model_len": "len",
}


class SweepError(ValueError):
    """A sweep that cannot be expanded; the message names the sweep and the key."""


def k_label(method: str, k) -> str:
    """How a variant's name gives its K: its method and K, `mtp2`, `ngramgpu4`, `suffix20`, `dflash15`."""
    return f"{method.replace('_', '')}{k}"


def label_for(axis: str, value, point: dict) -> str:
    if axis == "recipe":
        text = Path(str(value)).stem
    elif axis == "speculative.k":
        text = k_label(point["speculative"]["method"], value)
    elif axis == "speculative.method":
        text = str(value)
    else:
        text = PREFIXES.get(axis, axis.split(".", 1)[1].replace("_", "-")) + str(value).lower()
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower())


def axis_values(sweep: str, axis: str, values) -> list[tuple[str | None, object]]:
    """[(label or None for automatic, value)] of one axis, in declaration order."""
    if axis != "recipe" and (axis.count(".") != 1 or axis.split(".")[0] not in SECTIONS):
        raise SweepError(
            f"config key 'sweeps.{sweep}.axes.{axis}': an axis is `recipe`, `serve.<key>` or `speculative.<key>`"
        )
    if isinstance(values, dict):
        for label in values:
            if not NAME.match(str(label)):
                raise SweepError(f"config key 'sweeps.{sweep}.axes.{axis}': label {label!r} must match {NAME.pattern}")
        return [(str(label), value) for label, value in values.items()]
    if not isinstance(values, list) or not values:
        raise SweepError(f"config key 'sweeps.{sweep}.axes.{axis}': give a non-empty list or a mapping label -> value")
    return [(None, value) for value in values]


def set_axis(point: dict, axis: str, value) -> None:
    if axis == "recipe":
        point["recipe"] = value
    else:
        section, key = axis.split(".")
        point.setdefault(section, {})[key] = value


def canonical(settings: dict) -> str:
    return json.dumps(settings, sort_keys=True, separators=(",", ":"))


def expand(variants: dict, sweeps: dict, fill: Callable[[str, dict, str], dict]) -> tuple[dict, dict, dict]:
    """Expand every sweep over the catalog `variants` (defaults already filled).

    fill(name, point, sweep) validates a point and fills its defaults (the config schema's job).
    Returns (variants with the new points added, {sweep: [variant names]}, {new variant: sweep})."""
    out = dict(variants)
    by_settings: dict[str, str] = {}
    for name, settings in variants.items():
        by_settings.setdefault(canonical(settings), name)
    members: dict[str, list[str]] = {}
    origin: dict[str, str] = {}
    for sweep, spec in sweeps.items():
        base = spec["base"]
        if base not in variants:
            raise SweepError(
                f"config key 'sweeps.{sweep}.base': {base!r} is not a catalog variant ({', '.join(sorted(variants))})"
            )
        prefix = sweep if spec.get("prefix") is None else spec["prefix"]
        axes = [(axis, axis_values(sweep, axis, values)) for axis, values in spec["axes"].items()]
        members[sweep] = []
        for combination in itertools.product(*(values for _, values in axes)):
            point = copy.deepcopy(variants[base])
            for (axis, _), (_, value) in zip(axes, combination, strict=True):
                set_axis(point, axis, value)
            labels = [
                label or label_for(axis, value, point)
                for (axis, _), (label, value) in zip(axes, combination, strict=True)
            ]
            name = "-".join([prefix, *labels] if prefix else labels)
            if not NAME.match(name):
                raise SweepError(
                    f"config key 'sweeps.{sweep}': generated variant name {name!r} must match {NAME.pattern}"
                )
            point = fill(name, point, sweep)
            key = canonical(point)
            if name in out and canonical(out[name]) != key:
                where = f"sweep '{origin[name]}'" if name in origin else "variants:"
                raise SweepError(
                    f"config key 'sweeps.{sweep}': generates variant {name!r} with settings other than "
                    f"the {name!r} of {where}; rename one (a sweep's `prefix` or axis labels)"
                )
            name = by_settings.setdefault(key, name)  # identical settings: the variant that already has them
            if name not in out:
                out[name] = point
                origin[name] = sweep
            if name not in members[sweep]:
                members[sweep].append(name)
    return out, members, origin


def compared(
    names: list[str] | None, default_variant: str, variants: dict, members: dict, key: str = "compare.variants"
) -> list[str]:
    """The variants a list of variants and sweeps stands for (a sweep for its variants), each once, in order: what a
    comparison runs (compare.variants), or what select chooses among (select.candidates, `key`). None: the default
    variant and every sweep's variants."""
    if names is None:
        names = [default_variant, *members]
    result = []
    for index, name in enumerate(names):
        if name in members:
            new = members[name]
        elif name in variants:
            new = [name]
        else:
            raise SweepError(f"config key '{key}[{index}]': {name!r} is neither a variant nor a sweep")
        result += [n for n in new if n not in result]
    return result
