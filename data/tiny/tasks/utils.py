"""Helpers for the tiny lm-eval tasks. Scoring and prompt code is lm-eval's own (imported), so the tiny
tasks exercise the same functions as mmlu_pro / ifeval; only the data loading is ours."""

from __future__ import annotations

import json
from pathlib import Path

from lm_eval.tasks.ifeval.utils import agg_inst_level_acc, process_results  # noqa: F401  (IFEval scoring)
from lm_eval.tasks.mmlu_pro.utils import doc_to_text, fewshot_to_text  # noqa: F401  (MMLU-Pro prompt)

HERE = Path(__file__).resolve().parent


def _load(stem: str, splits: tuple[str, ...]):
    # Local files beside this module, whatever the working directory: no hub, no datasets cache.
    import datasets

    return datasets.DatasetDict(
        {
            split: datasets.Dataset.from_list(
                [json.loads(line) for line in (HERE / f"{stem}.{split}.jsonl").read_text().splitlines() if line]
            )
            for split in splits
        }
    )


def load_tiny_mc(**_):
    return _load("tiny_mc", ("test", "validation"))


def load_tiny_mc_think(**_):
    return _load("tiny_mc_think", ("test",))


def load_tiny_ifeval(**_):
    return _load("tiny_ifeval", ("test",))
