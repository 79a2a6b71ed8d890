"""quantize through its stage script on the tiny checkpoint (compress venv): every recipe, byte-identical reruns, the
guards that trip on a real run, fp32 products under the calibration, and vocabulary pruning, served by vLLM
(tests/unit/test_quantize.py: the guards and the recipes without torch)."""

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, TEST_TORCH_THREADS, TINY as TINY_ARGS, _up_to_date
from lib.dag.config import with_defaults
from lib.safetensors import checkpoint_header
from lib.stage import validate_json, write_manifest
from unit.test_quantize import (
    ARCH,
    EXPECTED,
    REAL,
    RECIPES,
    REPORT_SCHEMA,
    TINY,
)

# the scheduler's ordering: the recipe runs and the pruned checkpoint's server after the background build's quantize
# (and the SLURM module, which mostly waits, beside it and the bakes)
RUNS_AFTER = ("tiny_quantized",)
# ...and the session may probe the default image between two of its tests (scheduler.pytest_runtest_setup): its
# fixtures keep files only, every process a test starts ends with the test
PROBE_BETWEEN_TESTS = True


# ---- every recipe on the tiny checkpoint, through the stage script ----


def run_stage(python: Path, checkpoint: Path, recipe: str | Path, out: Path, **bounds) -> subprocess.CompletedProcess:
    # the rule's params as the tiny profile resolves them (schema defaults filled), a smaller calibration set
    resolved = with_defaults(TINY)
    bounds = {**{k: v for k, v in resolved["quantize"].items() if k != "heldout"}, **bounds}
    calibration = dict(resolved["calibration"], num_samples=8, max_seq_length=128, seed=0, chat=True)
    job = {
        "rule": "quantize",
        "log": [],
        "threads": TEST_TORCH_THREADS,
        "wildcards": {},
        "input": {
            "model": str(checkpoint),
            "model_manifest": str(out / "source-manifest.json"),  # download's manifest, checked before reading
            "recipe": str(recipe if isinstance(recipe, Path) else RECIPES / f"{recipe}.yaml"),
            "calibration": str(ROOT / "data" / "tiny" / "corpus.txt"),
            "heldout": str(ROOT / REAL["quantize"]["heldout"]),
            "keep_texts": [],  # what the rule adds for a pruning recipe (the probe's and the gate's texts)
            "schema": str(REPORT_SCHEMA),
        },
        "output": {
            "model": str(out / "model"),
            "manifest": str(out / "manifest.json"),
            "report": str(out / "report.json"),
        },
        "params": {
            "calibration": calibration,
            "quantize": bounds,
            "keep_sentence": None,
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(checkpoint, out / "source-manifest.json")
    (out / "job.json").write_text(json.dumps(job))
    return subprocess.run(
        [str(python), "scripts/quantize.py", "--job", str(out / "job.json")],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "scripts"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_venvs, tiny_checkpoint):
    """Each recipe run once on the tiny checkpoint (shared by the tests below); a recipe the tiny DAG's own quantize
    rule has made (the default variant's, test_slurm's second: made before this module) is read there, up to date."""
    done = {}

    def run(recipe):
        made = f"results/quantize/{recipe}"
        if recipe not in done and _up_to_date((f"{made}/manifest.json",), TINY_ARGS):
            done[recipe] = ROOT / made
        if recipe not in done:
            out = tmp_path_factory.mktemp(recipe)
            result = run_stage(tiny_venvs["compress"], tiny_checkpoint, recipe, out)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
            done[recipe] = out
        return done[recipe]

    return run


# Tensor bytes over the source's on the tiny model (its embeddings and vision stay 16-bit; a -head recipe adds the
# untied head's packed copy beside them, so it shrinks less than broad).
SHRINK = {
    "awq-w4a16-g32-mlp": 0.9,
    "awq-w4a16-g32-broad": 0.65,
    "awq-w4a16-g32-broad-head4": 0.65,
    "gptq-w4a16-g32-sym": 0.65,
    "w8a16": 0.8,
}


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# head8 differs from head4 only by a second config group (int8 channel-wise lm_head), which the planning tests cover;
# the real pruning size exceeds the tiny vocabulary: the tiny profile's own pruning recipe runs in its place; group 128
# differs from broad only by its group size, which the tiny model's narrow projections do not divide
TINY_PRUNE = ROOT / "recipes" / "tiny" / "awq-w4a16-g32-broad-head4-vocab2816.yaml"
RUN_ON_TINY = sorted(
    set(EXPECTED) - {"awq-w4a16-g32-broad-head8", "awq-w4a16-g32-broad-head4-vocab131k", "awq-w4a16-g128-broad"}
)


@pytest.mark.e2e
@pytest.mark.parametrize("recipe", RUN_ON_TINY)
def test_recipe_runs_on_the_tiny_checkpoint(runs, tiny_checkpoint, recipe):
    out = runs(recipe)
    count, bits = EXPECTED[recipe]
    report = json.loads((out / "report.json").read_text())
    validate_json(report, REPORT_SCHEMA)
    model = out / "model"
    header = checkpoint_header(model)
    packed = sorted(n[: -len(".weight_scale")] for n in header if n.endswith(".weight_scale"))
    assert report["quantized_modules"] == len(packed) == report["checks"]["expected_quantized_modules"] == count
    assert report["status"] == ("quantized" if count else "not quantized")
    mtp = {n: i["dtype"] for n, i in header.items() if n.startswith("mtp.")}
    assert mtp and set(mtp.values()) <= {"BF16", "F16"} and report["checks"]["mtp_tensors"] == len(mtp)
    for name in ("processor_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (model / name).read_bytes() == (tiny_checkpoint / name).read_bytes(), name
    # no Snakemake marker copied in from the source (the rule's own output has its own: the other recipes check this)
    own = {".snakemake_timestamp"} if out.is_relative_to(ROOT / "results") else set()
    assert not any(p.name.startswith(".") and p.name not in own for p in model.iterdir())
    heldout = report["checks"]["heldout"]
    assert heldout["top1_agreement"] >= TINY["quantize"]["min_top1_agreement"]
    assert heldout["ppl_ratio"] <= TINY["quantize"]["max_ppl_ratio"]
    weights = sum(i["bytes"] for i in header.values())
    source = sum(i["bytes"] for i in checkpoint_header(tiny_checkpoint).values())
    step = report["decode_step"]  # what a decode step reads: decoder + head, from the written headers
    # the tiny model ties its head as Qwen3.5-4B does: only the -head recipes untie it (and pack it)
    untied = "-head" in recipe
    head = sum(
        i["bytes"] for n, i in header.items() if n.startswith("lm_head" if untied else "model.language_model.embed_")
    )
    assert report["head"] == {
        "tied_in_source": True,
        "untied": untied,
        "untie_bytes": head if untied else 0,
        "quantized": untied,
    }
    assert step["lm_head"] == head and step["tied_head"] is not untied
    assert step["total"] == step["decoder"] + head < weights + (0 if untied else head)
    tie = json.loads((model / "config.json").read_text())
    assert tie["tie_word_embeddings"] is tie["text_config"]["tie_word_embeddings"] is not untied
    if count:
        qconfig = json.loads((model / "config.json").read_text())["quantization_config"]
        assert qconfig["config_groups"]["group_0"]["weights"]["num_bits"] == bits
        assert weights == report["checks"]["expected_weight_bytes"] < source * SHRINK[recipe]
    else:
        assert heldout["top1_agreement"] == 1.0 and heldout["ppl_ratio"] == 1.0
        assert report["quantization_config"] is None and weights == source
        assert all(
            (model / n).read_bytes() == (tiny_checkpoint / n).read_bytes() for n in ("model.safetensors", "config.json")
        )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest == {name: digest for name, digest in _digests(model).items() if name not in own}


@pytest.mark.e2e
def test_same_inputs_give_byte_identical_checkpoint(runs, tiny_venvs, tiny_checkpoint, tmp_path):
    first = runs("gptq-w4a16-g32-sym")
    result = run_stage(tiny_venvs["compress"], tiny_checkpoint, "gptq-w4a16-g32-sym", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    again = _digests(tmp_path / "model")
    assert any(n.endswith(".safetensors") for n in again)
    assert again == _digests(first / "model")
    assert (tmp_path / "manifest.json").read_bytes() == (first / "manifest.json").read_bytes()


@pytest.mark.e2e
def test_stage_fails_outside_the_heldout_bounds_and_leaves_nothing(tiny_venvs, tiny_checkpoint, tmp_path):
    result = run_stage(tiny_venvs["compress"], tiny_checkpoint, "w8a16", tmp_path, min_top1_agreement=1.0)
    assert result.returncode != 0
    assert "ERROR [quantize]: on the held-out text" in result.stderr and "agreement with the source" in result.stderr
    assert not (tmp_path / "model").exists() and not (tmp_path / "report.json").exists()
    assert not list(tmp_path.glob(".model.partial*"))


@pytest.mark.e2e
def test_stage_refuses_a_bad_recipe_before_loading_anything(tiny_venvs, tiny_checkpoint, tmp_path):
    recipe = tmp_path / "narrow.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                **yaml.safe_load((RECIPES / "w8a16.yaml").read_text()),
                "default_stage": {
                    "default_modifiers": {
                        "QuantizationModifier": {
                            "ignore": ["re:^mtp\\."],
                            "config_groups": {
                                "group_0": {
                                    "targets": ["re:.*in_proj_a$"],
                                    "weights": {
                                        "num_bits": 4,
                                        "type": "int",
                                        "symmetric": True,
                                        "strategy": "group",
                                        "group_size": 32,
                                    },
                                }
                            },
                        }
                    }
                },
            }
        )
    )
    result = run_stage(tiny_venvs["compress"], tiny_checkpoint, recipe, tmp_path / "out")
    assert result.returncode != 0 and "too narrow for the GPU int4 kernel" in result.stderr
    # refused by the plan, before torch, the tokenizer or the model (not a wall-clock bound: CPUs differ)
    assert "modules to quantize" not in result.stdout and "calibration:" not in result.stdout
    assert not (tmp_path / "out" / "model").exists()


def run_in_compress_venv(tiny_venvs, code: str) -> subprocess.CompletedProcess:
    """`python -c code` in the compress venv, from the project root with scripts/ (lib) importable."""
    return subprocess.run(
        [str(tiny_venvs["compress"]), "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT / "scripts"), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )


@pytest.mark.e2e
def test_after_guard_checkpoint_must_reload(runs, tiny_venvs, tmp_path):
    import shutil

    broken = tmp_path / "model"
    shutil.copytree(runs("w8a16") / "model", broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    code = (
        "import sys; from lib.stage import StageError; from lib.quantize.checks import load_model\n"
        f"try: load_model({str(broken)!r}, {ARCH!r}, 'written')\n"
        "except StageError as e: print(e); sys.exit(3)\n"
    )
    result = run_in_compress_venv(tiny_venvs, code)
    assert result.returncode == 3 and "does not load with transformers" in result.stdout, result.stderr[-2000:]


HALF_PRODUCTS = """
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from serving.patches.avx2_fp32 import HalfProductsInFp32

class KernelDtypes(TorchDispatchMode):  # the dtypes each aten kernel was given
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen.append((func.__name__.split(".")[0], {a.dtype for a in args if isinstance(a, torch.Tensor)}))
        return func(*args, **(kwargs or {}))

torch.manual_seed(0)
linear, conv = torch.nn.Linear(96, 48).bfloat16(), torch.nn.Conv1d(64, 64, 4, groups=64, padding=3).bfloat16()
x, seq = torch.randn(5, 96, dtype=torch.bfloat16), torch.randn(2, 64, 9, dtype=torch.bfloat16)
w32, b32, cw32, cb32 = linear.weight.float(), linear.bias.float(), conv.weight.float(), conv.bias.float()
seen = []
with torch.no_grad(), KernelDtypes(), HalfProductsInFp32():
    y, out = linear(x), conv(seq)
    kw = F.conv1d(seq, conv.weight, bias=None, padding=3, groups=64)  # as transformers' GDN calls it
    mm = torch.matmul(x, linear.weight.T)  # only linear and conv1d are rerouted
    y32 = F.linear(x.float(), w32, b32)  # fp32 work is torch's own
products = [(name, dtypes) for name, dtypes in seen if name in ("addmm", "mm", "convolution")]
assert products == [("addmm", {torch.float32}), ("convolution", {torch.float32}), ("convolution", {torch.float32}),
                    ("mm", {torch.bfloat16}), ("addmm", {torch.float32})], products
assert y.dtype == out.dtype == kw.dtype == torch.bfloat16
assert torch.equal(y, F.linear(x.float(), w32, b32).bfloat16()) and torch.equal(y32, F.linear(x.float(), w32, b32))
assert torch.equal(out, F.conv1d(seq.float(), cw32, cb32, padding=3, groups=64).bfloat16())
assert torch.equal(kw, F.conv1d(seq.float(), cw32, None, padding=3, groups=64).bfloat16())
print("ok")
"""


@pytest.mark.e2e
def test_calibration_computes_half_precision_products_in_fp32(tiny_venvs):
    """quantize runs transformers' layers under serving/patches/avx2_fp32.py's HalfProductsInFp32: a bf16 linear layer
    and depthwise convolution reach their kernels in fp32 and come back rounded to bf16; other ops stay as called."""
    result = run_in_compress_venv(tiny_venvs, HALF_PRODUCTS)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# ---- vocabulary pruning on the tiny checkpoint, through the stage script ----

ROUND_TRIP = """
import json, sys
from transformers import AutoTokenizer
source, pruned = (AutoTokenizer.from_pretrained(d) for d in sys.argv[1:3])
text = sys.argv[3]
kept = {t: i for t, i in pruned.get_vocab().items()}
old, new = source(text, add_special_tokens=False)["input_ids"], pruned(text, add_special_tokens=False)["input_ids"]
print(json.dumps({
    "round_trip": pruned.decode(new) == text,
    "same_pieces": [kept.get(source.convert_ids_to_tokens(i)) for i in old] == new,
    "all_source_pieces_kept": all(source.convert_ids_to_tokens(i) in kept for i in old),
    "specials": [pruned.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")],
}))
"""


# Text no tiny corpus, task or probe uses (so some of its pieces were pruned away): markdown, code, numbers and
# punctuation of the kind a user sends. Fixed here, not read from a doc, so editing the docs cannot change the test.
UNSEEN_TEXT = """# Measuring a decode step

| variant | median ms | p90 ms | tokens/s |
|---|---|---|---|
| awq-w4a16-g32 (K=2) | 3.08 | 3.41 | 324.7 |
| bf16, speculation off | 4.52 | 4.97 | 221.2 |

Run `snakemake --cores 4 results/summary.json --config 'select={mode: fastest}'`, then read
results/summary.md; a row's bytes/step (e.g. 3.29e9) over 600 GB/s gives its floor: ~5.5 ms.
Why? Because each step re-reads every weight once -- {"k": 2, "method": "mtp"} changes how many
tokens one read yields, not the read itself. [link](https://example.org/a?b=c&d=%20e#f) <br/> 42%!
"""


@pytest.fixture(scope="module")
def pruned(tiny_venvs, tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny profile's pruning recipe (int4 head on 2,816 ids) run once through the stage."""
    out = tmp_path_factory.mktemp("pruned")
    result = run_stage(tiny_venvs["compress"], tiny_checkpoint, TINY_PRUNE, out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return out


@pytest.mark.e2e
def test_vocabulary_pruning_on_the_tiny_checkpoint(pruned, tiny_venvs, tiny_checkpoint):
    tmp_path = pruned
    report = json.loads((tmp_path / "report.json").read_text())
    validate_json(report, REPORT_SCHEMA)
    source_config = json.loads((tiny_checkpoint / "config.json").read_text())
    model = tmp_path / "model"
    config = json.loads((model / "config.json").read_text())
    vocab = report["vocab"]
    assert vocab["rows_before"] == source_config["text_config"]["vocab_size"] > vocab["rows"] == 2816
    assert config["text_config"]["vocab_size"] == 2816 and vocab["sliced_tensors"] == [
        "model.language_model.embed_tokens.weight"
    ]
    written = checkpoint_header(model)
    assert written["model.language_model.embed_tokens.weight"]["shape"][0] == 2816
    assert written["lm_head.weight_packed"]["shape"][0] == 2816  # untied, then packed: rows of the pruned vocabulary
    assert report["head"]["untied"] and report["decode_step"]["lm_head"] == report["head"]["untie_bytes"]
    assert vocab["heldout"]["top1_agreement"] >= TINY["quantize"]["min_top1_agreement"]
    # every id field names the same token as before
    tokens = json.loads((model / "tokenizer.json").read_text())["added_tokens"]
    content = {t["id"]: t["content"] for t in tokens}
    source_tokens = json.loads((tiny_checkpoint / "tokenizer.json").read_text())["added_tokens"]
    source_content = {t["id"]: t["content"] for t in source_tokens}
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert content[config[key]] == source_content[source_config[key]], key
    generation = json.loads((model / "generation_config.json").read_text())
    source_generation = json.loads((tiny_checkpoint / "generation_config.json").read_text())
    assert [content[i] for i in generation["eos_token_id"]] == [
        source_content[i] for i in source_generation["eos_token_id"]
    ]
    # text no test saw: it round-trips; where every original piece survived, it splits into the same pieces
    unseen = UNSEEN_TEXT + " Zürich ½ 東京 🚀"
    checked = subprocess.run(
        [str(tiny_venvs["compress"]), "-c", ROUND_TRIP, str(tiny_checkpoint), str(model), unseen],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert checked.returncode == 0, checked.stderr[-3000:]
    seen = json.loads(checked.stdout.strip().splitlines()[-1])
    assert seen["round_trip"] and seen["same_pieces"] is seen["all_source_pieces_kept"]
    assert len(set(seen["specials"])) == 3 and all(0 <= i < 2816 for i in seen["specials"])


@pytest.mark.e2e
def test_the_pruned_checkpoint_serves_on_vllm(pruned, tiny_venvs, tmp_path):
    """vLLM's CPU build loads the pruned vocabulary with its untied int4 head and answers in text."""
    import urllib.request

    from conftest import SERVE_JSON, host_server

    def post(base, path, body):
        request = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=300).read())

    with host_server(pruned / "model", dict(SERVE_JSON), tmp_path) as base:
        name = SERVE_JSON["served_model_name"]
        chat = post(
            base,
            "/v1/chat/completions",
            {"model": name, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12},
        )
        assert chat["choices"][0]["message"]["content"].strip()
        ids = post(base, "/tokenize", {"model": name, "prompt": "The quick brown fox <|im_end|>"})["tokens"]
        assert ids and max(ids) < 2816
    assert "quantization=compressed-tensors" in (tmp_path / "server.log").read_text()


@pytest.mark.e2e
def test_a_pruning_size_below_the_required_tokens_fails_before_any_work(tiny_venvs, tiny_checkpoint, tmp_path):
    recipe = yaml.safe_load(TINY_PRUNE.read_text())
    recipe["pipeline"]["prune_vocab"]["size"] = 512
    path = tmp_path / "too-small.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = run_stage(tiny_venvs["compress"], tiny_checkpoint, path, tmp_path / "out")
    assert result.returncode != 0
    assert "pipeline.prune_vocab: size 512 is smaller than the" in result.stderr and "must survive" in result.stderr
    assert not (tmp_path / "out" / "model").exists() and not list((tmp_path / "out").glob(".model.*"))
