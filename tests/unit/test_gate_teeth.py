"""The tiny quality gate's thresholds sit above chance, so the gate can tell a trained model from a destroyed one
(tests/e2e/test_gate_teeth.py shows it does)."""

import yaml

from conftest import ROOT

TINY = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
CHANCE = {"tiny_mc": 0.25, "tiny_mc_think": 0.25}  # four options, letters balanced; IFEval has no chance level


def test_thresholds_sit_above_chance():
    for task in TINY["quality"]["tasks"]:
        assert task["threshold"] > CHANCE.get(task["name"], 0.0), task
