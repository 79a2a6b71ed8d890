"""A config check that needs a complete tiny run on disk: a recipe path that names nothing fails the run instead of
shipping the old image (tests/unit/test_config.py: the checks themselves)."""

import pytest
import yaml

from conftest import TINY, snakemake, with_recipe
from unit.test_config import tiny_config


@pytest.mark.e2e
def test_a_missing_recipe_after_a_complete_run_fails_instead_of_shipping_the_old_image(tiny_run, tmp_path):
    """With outputs of a complete run on disk, a recipe path that names nothing used to plan "Nothing to be done"
    (the stale quantize outputs were taken as sources) and keep the old image."""
    config = with_recipe(tiny_config(), "recipes/renamed.yaml")
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump(config))
    for args in (("-n",), ("--cores", "2"), ("--cores", "2", "-F")):
        result = snakemake(*args, *TINY, str(override), check=False)
        message = result.stdout + result.stderr
        assert result.returncode != 0, args
        assert f"config key 'variants.{config['variant']}.recipe': recipes/renamed.yaml does not exist" in message
        assert "Nothing to be done" not in message
