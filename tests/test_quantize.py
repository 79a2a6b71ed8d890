import json
import subprocess
from pathlib import Path

import pytest

from common import StageError
from quantize import _as_chat, load_calibration_texts

ROOT = Path(__file__).resolve().parents[1]
TINY_CHECKPOINT = ROOT / "weights" / "tiny-qwen3.5" / "checkpoint"


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(f"Paragraph number {i}. It has a second sentence." for i in range(50)) + "\n\n  \n")
    return path


def test_missing_file_is_a_stage_error(tmp_path):
    with pytest.raises(StageError, match="not found"):
        load_calibration_texts("text_file", 4, 0, path=str(tmp_path / "absent.txt"))


def test_blank_file_is_a_stage_error(tmp_path):
    path = tmp_path / "blank.txt"
    path.write_text("\n   \n\t\n")
    with pytest.raises(StageError, match="no non-empty lines"):
        load_calibration_texts("text_file", 4, 0, path=str(path))


@pytest.mark.parametrize("bad", [0, -3, None, "8"])
def test_num_samples_must_be_positive(corpus, bad):
    with pytest.raises(StageError, match="num_samples"):
        load_calibration_texts("text_file", bad, 0, path=str(corpus))


def test_unknown_source_and_missing_dataset(corpus):
    with pytest.raises(StageError, match="text_file or hf_dataset"):
        load_calibration_texts("csv", 4, 0, path=str(corpus))
    with pytest.raises(StageError, match="dataset is not set"):
        load_calibration_texts("hf_dataset", 4, 0)


def test_seeded_selection_is_deterministic_and_sized(corpus):
    first = load_calibration_texts("text_file", 10, 7, path=str(corpus))
    assert first == load_calibration_texts("text_file", 10, 7, path=str(corpus))
    assert len(first) == len(set(first)) == 10
    assert first != load_calibration_texts("text_file", 10, 8, path=str(corpus))
    assert all(line.startswith("Paragraph number") for line in first)  # blank lines never picked


def test_num_samples_caps_at_available_lines(corpus):
    texts = load_calibration_texts("text_file", 1000, 0, path=str(corpus))
    assert sorted(texts) == sorted(f"Paragraph number {i}. It has a second sentence." for i in range(50))


def test_chat_wrapping_splits_a_paragraph_into_two_turns():
    assert _as_chat("First sentence here. And the rest.") == [
        {"role": "user", "content": "First sentence here."}, {"role": "assistant", "content": "And the rest."}]
    user, assistant = _as_chat("one two three four")
    assert (user["content"], assistant["content"]) == ("one two", "three four")


def _tensor_dtypes(directory: Path) -> dict[str, str]:
    out = {}
    for shard in directory.glob("*.safetensors"):
        with open(shard, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        out.update({k: v["dtype"] for k, v in header.items() if k != "__metadata__"})
    return out


@pytest.mark.e2e
def test_quantize_tiny_checkpoint(tmp_path, tiny_venvs):
    if not (TINY_CHECKPOINT / "config.json").exists():
        from conftest import TINY, snakemake
        snakemake("--cores", "2", *TINY, str(TINY_CHECKPOINT.relative_to(ROOT)))
    out = tmp_path / "model"
    job = {"rule": "quantize", "log": [], "threads": 2, "wildcards": {},
           "input": {"model": str(TINY_CHECKPOINT), "recipe": str(ROOT / "recipes" / "awq-w4a16-g32.yaml"),
                     "calibration": str(ROOT / "data" / "tiny" / "corpus.txt")},
           "output": {"model": str(out), "manifest": str(tmp_path / "manifest.json"),
                      "report": str(tmp_path / "report.json")},
           "params": {"calibration": {"source": "text_file", "num_samples": 16, "max_seq_length": 128,
                                      "seed": 0, "chat": True}}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    result = subprocess.run([str(tiny_venvs["compress"]), "scripts/quantize.py", "--job", str(tmp_path / "job.json")],
                            cwd=ROOT, env={"PYTHONPATH": str(ROOT / "scripts"), "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = qconfig["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["strategy"], weights["symmetric"]) == (4, 32, "group", True)

    dtypes = _tensor_dtypes(out)
    mtp = {k: v for k, v in dtypes.items() if k.startswith("mtp.")}
    assert mtp and set(mtp.values()) <= {"BF16", "F16"}
    packed = {k for k in dtypes if k.endswith(".weight_packed")}
    assert any("linear_attn.in_proj_qkv" in k for k in packed) and any("mlp.down_proj" in k for k in packed)
    for name in ("in_proj_a", "in_proj_b", "lm_head", "visual", "mtp."):
        assert not any(name in k for k in packed), name
    assert any(k.endswith("linear_attn.in_proj_a.weight") for k in dtypes)

    for name in ("processor_config.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file(), name
    assert (out / "tokenizer.json").is_file() or (out / "vocab.json").is_file()
    assert not list(tmp_path.glob(".model.partial*"))

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["calibration"]["samples_used"] == 16
    assert report["quantized_modules"] == len(packed)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert set(manifest) == {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
