"""The config schema (schemas/config.schema.yaml), home of every config default."""

import copy
from pathlib import Path

import yaml

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "config.schema.yaml"


def load() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _defaults(properties: dict) -> dict:
    return {key: copy.deepcopy(prop["default"]) for key, prop in properties.items() if "default" in prop}


def defaults_of(definition: str) -> dict:
    """The defaults of one `$defs` entry (e.g. "task"), for code that completes such an object itself."""
    return _defaults(load()["$defs"][definition]["properties"])


def section_defaults(section: str) -> dict:
    """The defaults of one top-level config section (e.g. "probe"), for code run outside Snakemake (gpu_proof/)
    that completes the section as the rules would pass it."""
    return _defaults(load()["properties"][section]["properties"])
