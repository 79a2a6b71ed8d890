"""The config schema (schemas/config.schema.yaml), home of every config default."""

import copy
from pathlib import Path

import yaml

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "config.schema.yaml"


def load() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def defaults_of(definition: str) -> dict:
    """The defaults of one `$defs` entry (e.g. "task"), for code that completes such an object itself."""
    properties = load()["$defs"][definition]["properties"]
    return {key: copy.deepcopy(prop["default"]) for key, prop in properties.items() if "default" in prop}
