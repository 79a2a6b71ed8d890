"""The GPU proof's checkpoint and drafter builders on the current tiny model code, in the compress venv
(tests/unit/test_gpu_proof.py: the records and the driver against a stand-in server)."""

import hashlib
import json
import subprocess

import pytest

from conftest import ROOT


@pytest.mark.e2e  # the compress venv (torch, transformers)
def test_the_checkpoint_and_drafter_builders_run_on_the_current_tiny_model_api(tmp_path, tiny_venvs):
    """The device-side builders use scripts/lib/tiny (a change there broke the checkpoint builder once on an H100):
    the same scripts, small dims, on CPU; the drafter is made for that checkpoint."""
    dims = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "max_position_embeddings": 4096,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    }
    build = [str(tiny_venvs["compress"]), str(ROOT / "gpu_proof" / "build_checkpoint.py")]
    cpu = ["--device", "cpu"]
    subprocess.run(
        [
            *build,
            str(tmp_path / "model"),
            str(tmp_path / "c.json"),
            *cpu,
            "--dims",
            json.dumps(dims),
            "--vocab",
            "4160",
        ],
        check=True,
        timeout=600,
    )
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["text_config"]["hidden_size"] == 64 and data["text_config"]["vocab_size"] == 4160
    shards = sorted(p.name for p in (tmp_path / "model").glob("*.safetensors"))
    assert shards and sorted(data["weights_sha256"]) == shards
    assert (
        data["weights_sha256"][shards[0]] == hashlib.sha256((tmp_path / "model" / shards[0]).read_bytes()).hexdigest()
    )
    drafter_dims = {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    drafter_dims |= {"head_dim": 32, "intermediate_size": 96, "target_layer_ids": [0, 2], "block_size": 4}
    subprocess.run(
        [*build, "--drafter", str(tmp_path / "drafter"), str(tmp_path / "d.json"), "--target", str(tmp_path / "model")]
        + [*cpu, "--dims", json.dumps(drafter_dims)],
        check=True,
        timeout=600,
    )
    drafter = json.loads((tmp_path / "d.json").read_text())
    config = drafter["config"]
    assert config["architectures"] == ["DFlashDraftModel"] and config["vocab_size"] == 4160
    assert config["dflash_config"]["mask_token_id"] < 4160 and config["target_hidden_size"] == 64
    fc, attention, mlp, norms = 64 * 2 * 64, 64 * 64 * 2 + 32 * 64 * 2, 3 * 64 * 96, 2 * 32 + 4 * 64
    assert drafter["total_params"] == fc + attention + mlp + norms
