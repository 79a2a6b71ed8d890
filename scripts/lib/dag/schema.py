"""The config schema (schemas/config.schema.yaml), home of every config default."""

import copy
import functools
from pathlib import Path

import yaml

# inputs of the rules whose script imports this (lib/dag/imports.py)
DATA_FILES = ("../../../schemas/config.schema.yaml",)
SCHEMA_PATH = (Path(__file__).parent / DATA_FILES[0]).resolve()


@functools.cache
def _parsed() -> dict:
    # Parsed once a process: every `snakemake` run checks the config against it several times (sweep points too),
    # and pure-Python YAML parsing was half of a dry run's 2 s. libyaml's loader where PyYAML has it.
    return yaml.load(SCHEMA_PATH.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def load() -> dict:
    """The schema, a copy of its own for each caller."""
    return copy.deepcopy(_parsed())


def _defaults(properties: dict) -> dict:
    return {key: copy.deepcopy(prop["default"]) for key, prop in properties.items() if "default" in prop}


def defaults_of(definition: str) -> dict:
    """The defaults of one `$defs` entry (e.g. "task"), for code that completes such an object itself."""
    return _defaults(load()["$defs"][definition]["properties"])


def section_defaults(section: str) -> dict:
    """The defaults of one top-level config section (e.g. "probe"), for code run outside Snakemake (gpu_proof/)
    that completes the section as the rules would pass it."""
    return _defaults(load()["properties"][section]["properties"])
