"""download and train_tiny for real: the hub path through huggingface_hub (compress venv) against a local stand-in
of the hub (tests/support/hub_standin.py), the tiny checkpoint built, trained and checked in the compress venv, and
loaded by transformers and vLLM (tests/unit/test_download.py: the parts that run under plain python3)."""

import hashlib
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT, TEST_TORCH_THREADS, vllm_cache_root
from hub_standin import StandinHub, git_blob_sha1 as blob_sha1_of, run_stage_script
from lib.checkpoint import verify_manifest
from lib.safetensors import read_header
from lib.stage import StageError
from lib.tiny import synthesis, tokenizer as tiny_tokenizer
from unit.test_download import (
    COMMIT,
    CORPUS,
    GENERATOR,
    HUB_FILES,
    HUB_LFS,
    NO_MTP,
    SENTENCE,
    flipped,
    hub_listing,
    job,
)

COMPRESS = ROOT / ".venvs" / "compress" / "bin" / "python"
SERVE = ROOT / ".venvs" / "serve-cpu" / "bin" / "python"

# Exactly what vLLM's Qwen3_5MultiTokenPredictor loads (qwen3_5_mtp.py: mtp.* -> model.*).
MTP_NAMES = {
    "mtp.fc.weight",
    "mtp.norm.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.layers.0.input_layernorm.weight",
    "mtp.layers.0.post_attention_layernorm.weight",
    *(f"mtp.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")),
    *(f"mtp.layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")),
}


# --- the hub path for real: huggingface_hub (compress venv) against a local stand-in of the hub ---------------------


@pytest.fixture
def local_hub():
    with StandinHub() as hub:
        hub.add("Qwen/Qwen3.5-4B", COMMIT, HUB_FILES, lfs=HUB_LFS)
        yield hub


def hub_download(tmp_path, hub, name="a") -> tuple[subprocess.CompletedProcess, SimpleNamespace]:
    """download for source hub as run_stage re-runs it in the compress venv, HF_ENDPOINT at the stand-in."""
    j = job(tmp_path / name)
    j.output.record = str(Path(j.output.manifest).with_name("download.json"))
    job_dict = {k: vars(v) if isinstance(v, SimpleNamespace) else v for k, v in vars(j).items()}
    result = run_stage_script(COMPRESS, ROOT / "scripts" / "download.py", job_dict, hub, tmp_path, timeout=120)
    return result, j


@pytest.mark.e2e
def test_hub_path_against_a_local_hub_verifies_and_records_every_file(tmp_path, tiny_venvs, local_hub):
    result, j = hub_download(tmp_path, local_hub)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = Path(j.output.checkpoint)
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == HUB_FILES  # no .cache bookkeeping
    record = json.loads(Path(j.output.record).read_text())
    assert record["source"] == "hub" and record["files"] == 3
    assert record["hub"] == {"repo": "Qwen/Qwen3.5-4B", "revision": COMMIT, "files": hub_listing()}
    manifest = json.loads(Path(j.output.manifest).read_text())
    assert manifest == {name: hashlib.sha256(data).hexdigest() for name, data in HUB_FILES.items()}
    # huggingface_hub asked what it asks the hub: the tree listing, each file's metadata, the LFS file from storage
    asked = {(method, host, path.split("?")[0]) for method, host, path in local_hub.requests}
    resolve = f"/Qwen/Qwen3.5-4B/resolve/{COMMIT}/"
    assert ("GET", "127.0.0.1", f"/api/models/Qwen/Qwen3.5-4B/tree/{COMMIT}") in asked
    assert {("HEAD", "127.0.0.1", resolve + name) for name in HUB_FILES} <= asked
    lfs_sha256 = record["hub"]["files"]["model.safetensors"]["sha256"]
    assert ("GET", "localhost", f"/lfs/{lfs_sha256}") in asked  # the LFS file from the storage host it redirects to
    assert ("GET", "127.0.0.1", resolve + "config.json") in asked  # a small file from the hub itself
    assert local_hub.unexpected == []
    assert "each matching the hub's hash" in result.stdout


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_hub_path_against_a_local_hub_fails_on_a_corrupted_file_naming_it(tmp_path, tiny_venvs, local_hub, name):
    """The hub lists a file's hash; the bytes it serves differ (same length). The stage fails naming the file, the
    hub's hash and the download's, and leaves nothing: no checkpoint, .partial, manifest or record."""
    local_hub.serve_instead("Qwen/Qwen3.5-4B", name, flipped(HUB_FILES[name]))
    result, j = hub_download(tmp_path, local_hub)
    assert result.returncode == 1
    listed = hub_listing()[name]
    kind, hub_hash = ("LFS sha256", listed["sha256"]) if "sha256" in listed else ("git blob sha1", listed["git_sha1"])
    served = flipped(HUB_FILES[name])
    actual = hashlib.sha256(served).hexdigest() if "sha256" in listed else blob_sha1_of(served)
    assert (
        f"ERROR [download]: Qwen/Qwen3.5-4B@{COMMIT}: the download does not match the hub's own hashes" in result.stderr
    )
    problems = {line.strip() for line in result.stderr.splitlines() if line.startswith("  ")}
    assert problems == {f"{name}: the hub's {kind} is {hub_hash}, the downloaded file's is {actual}"}  # that file only
    assert list(Path(j.output.checkpoint).parent.iterdir()) == []


@pytest.mark.e2e
def test_hub_path_rerun_after_tampering_refetches_and_reverifies(tmp_path, tiny_venvs, local_hub):
    """A checkpoint changed after download is refused by the stage that reads it (quantize); rerunning download (what
    removing the checkpoint makes Snakemake do) fetches and verifies it against the hub again."""
    result, j = hub_download(tmp_path, local_hub)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = Path(j.output.checkpoint)
    (checkpoint / "model.safetensors").write_bytes(flipped(HUB_FILES["model.safetensors"]))
    with pytest.raises(StageError, match="model.safetensors: sha256 "):
        verify_manifest(checkpoint, j.output.manifest)
    local_hub.requests.clear()
    result, j = hub_download(tmp_path, local_hub)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (checkpoint / "model.safetensors").read_bytes() == HUB_FILES["model.safetensors"]
    verify_manifest(checkpoint, j.output.manifest)
    assert any(path.startswith("/lfs/") for _, _, path in local_hub.requests)  # fetched again, not reused


# --- the built tiny checkpoint (compress venv) ------------------------------------------------

SHORT_TRAINING = {
    **NO_MTP,
    "steps": 3,
    "lr": 0.004,
    "warmup_steps": 1,
    "batch_size": 4,
    "seed": 0,
    "data_seed": 7,
    "examples": 12,
    "heldout_examples": 3,
    "threads": TEST_TORCH_THREADS,
}
# ...with repeated texts and a few MTP steps (the MTP shard is then trained too)
SHORT_MTP_TRAINING = {**SHORT_TRAINING, "repeat_examples": 8, "mtp_steps": 3}


def run_in_venv(script: str, stage_job: SimpleNamespace, job_file: Path) -> None:
    """A stage as run_stage re-runs it: `python scripts/<stage>.py --job job.json` in the compress venv."""
    job_file.write_text(
        json.dumps({k: vars(v) if isinstance(v, SimpleNamespace) else v for k, v in vars(stage_job).items()})
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "scripts"), TOKENIZERS_PARALLELISM="false")
    subprocess.run(
        [str(COMPRESS), str(ROOT / "scripts" / script), "--job", str(job_file)],
        check=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )


def download_in_venv(tmp_path, name, for_training=False) -> SimpleNamespace:
    """download as the tiny profile's rule runs it (with the training generator as an input when train_tiny follows,
    as its tokenizer then learns the task wording); returns its job, whose outputs are the checkpoint, manifest and
    record."""
    folder = tmp_path / name
    j = job(
        folder / "untrained" if for_training else folder,
        source="synthetic",
        tiny={"seed": 0, "vocab_size": 4096},
        corpus=CORPUS,
    )
    j.output.record = str(Path(j.output.manifest).with_name("download.json"))
    if for_training:
        j.input.generator = str(GENERATOR)
    run_in_venv("download.py", j, tmp_path / f"{name}.json")
    return j


def train_in_venv(tmp_path, name, downloaded: SimpleNamespace, train: dict) -> tuple[Path, Path]:
    """train_tiny on download's outputs (download_in_venv's job) as the rule runs it, into <tmp_path>/<name>/weights/m
    (its record is download.json there). Returns the trained checkpoint and manifest."""
    out = tmp_path / name / "weights" / "m"
    trained = SimpleNamespace(
        rule="train_tiny",
        log=[],
        threads=TEST_TORCH_THREADS,
        input=SimpleNamespace(
            checkpoint=downloaded.output.checkpoint,
            manifest=downloaded.output.manifest,
            record=downloaded.output.record,
            generator=str(GENERATOR),
        ),
        params=SimpleNamespace(seed=0, train=train, sentence=SENTENCE),
        output=SimpleNamespace(
            checkpoint=str(out / "checkpoint"), manifest=str(out / "manifest.json"), record=str(out / "download.json")
        ),
    )
    run_in_venv("train_tiny.py", trained, tmp_path / f"{name}-train.json")
    return Path(trained.output.checkpoint), Path(trained.output.manifest)


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_venvs):
    tmp = tmp_path_factory.mktemp("tiny")
    return tuple((Path(j.output.checkpoint), Path(j.output.manifest)) for j in (download_in_venv(tmp, n) for n in "ab"))


def headers(checkpoint):
    return {path.name: read_header(path) for path in sorted(checkpoint.glob("*.safetensors"))}


@pytest.mark.e2e
def test_same_seed_gives_byte_identical_checkpoints(built):
    (first, manifest_a), (second, manifest_b) = built
    a, b = json.loads(manifest_a.read_text()), json.loads(manifest_b.read_text())
    assert a == b
    for name in a:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


@pytest.mark.e2e
def test_training_is_deterministic_and_recorded(tmp_path, tiny_venvs, built):
    """The model and its MTP layer (SHORT_MTP_TRAINING trains both): same settings, same bytes; the record (schema-
    checked by the stage) holds both trainings and the MTP's acceptance per K."""
    downloaded = download_in_venv(tmp_path, "a", for_training=True)  # download's own determinism: `built`
    (first, manifest_a), (second, manifest_b) = (
        train_in_venv(tmp_path, name, downloaded, SHORT_MTP_TRAINING) for name in "ab"
    )
    assert json.loads(manifest_a.read_text()) == json.loads(manifest_b.read_text())
    record = json.loads((tmp_path / "a" / "weights" / "m" / "download.json").read_text())
    training = record["training"]
    assert training["steps"] == 3 and training["final_loss"] < training["first_loss"]
    assert training["repeat_examples"] == 8
    mtp = training["mtp"]
    assert mtp["steps"] == 3 and training["mtp_final_loss"] == mtp["final_loss"]
    assert [row["k"] for row in mtp["acceptance"]["repeated"]] == [1, 2]
    assert mtp["heldout"]["repeated_prompts"] == 2 and len(mtp["heldout"]["repeat_exact_tokens"]) == 2
    # training changed the weights and the MTP layer (an untrained build is the seed-0 random model), keeping the
    # MTP tensors' names and dtypes (what vLLM loads) and the index
    (untrained, _), _ = built  # the same download job, without training
    assert (first / "model.safetensors").read_bytes() != (untrained / "model.safetensors").read_bytes()
    assert (first / synthesis.MTP_FILE).read_bytes() != (untrained / synthesis.MTP_FILE).read_bytes()
    trained_mtp, random_mtp = read_header(first / synthesis.MTP_FILE), read_header(untrained / synthesis.MTP_FILE)
    assert set(trained_mtp) == MTP_NAMES and {n: (t["dtype"], t["shape"]) for n, t in trained_mtp.items()} == {
        n: (t["dtype"], t["shape"]) for n, t in random_mtp.items()
    }
    # the same tensors in the same files (sizes may differ: an untrained build's tokenizer learns no task wording)
    index_of = lambda checkpoint: json.loads((checkpoint / synthesis.INDEX_FILE).read_text())["weight_map"]  # noqa: E731
    assert index_of(first) == index_of(untrained)


MTP_CHAIN = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText
from lib.tiny import mtp as M
torch.manual_seed(0)
d = sys.argv[1]
model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
tensors = load_file(d + "/model-mtp.safetensors")
layer = M.make_mtp(model.config.text_config)
M.load_tensors(layer, tensors)
saved = M.to_tensors(layer)
assert list(saved) == sorted(tensors) and all(torch.equal(saved[n], tensors[n]) for n in tensors)  # bytes round-trip
for t in layer.state_dict().values():  # a random layer decides little: give it weights that tell chains apart
    t.add_(torch.randn_like(t) * 0.05)
ids = torch.randint(0, 2000, (2, 12))
with torch.no_grad():
    hidden = M.target_hidden(model, ids)
    drafts = M.draft_chains(model, layer, ids, hidden, 3)
    assert torch.equal(drafts[..., 0], M.mtp_logits(model, layer, ids, hidden).argmax(-1))
    text = model.model.language_model
    # chain t by hand, as vLLM's proposer runs it: the MTP over positions 0..t from the target's hidden states
    # and tokens, then one position a draft step, each reading the previous step's output and draft
    for t in (0, 4, 9):
        e, h = text.embed_tokens(ids[:, 1:t + 2]), hidden[:, :t + 1]
        for step in range(3):
            n = e.shape[1]
            mask = M.causal_mask(torch.ones(n, n, dtype=torch.bool).tril().expand(2, 1, -1, -1), e.dtype)
            out = layer(e, h, M._rope(text, e, torch.arange(n)), mask)
            guess = model.lm_head(out[:, -1]).argmax(-1)
            assert torch.equal(guess, drafts[:, t, step]), (t, step)
            e = torch.cat([e, text.embed_tokens(guess)[:, None]], 1)
            h = torch.cat([h, out[:, -1:]], 1)
print("CHAINS OK")
"""


@pytest.mark.e2e
def test_mtp_drafts_chain_as_vllms_proposer_runs_them(built):
    """draft_chains (all positions at once, one masked pass a step) gives what the MTP layer gives run step by step
    as vLLM's proposer runs it; the layer loads and writes the checkpoint's `mtp.*` tensors bit for bit."""
    (checkpoint, _), _ = built
    assert "CHAINS OK" in run_on_checkpoint(COMPRESS, MTP_CHAIN, checkpoint, ROOT / "scripts")


MTP_TEETH = """
import json, sys, torch
sys.path.insert(0, sys.argv[2])
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoTokenizer
from lib.tiny import mtp as M, synthesis
d = sys.argv[1]
tok = AutoTokenizer.from_pretrained(d)
model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
config = json.loads(open(d + "/config.json").read())
texts = [{"sentence": sys.argv[3], "text": sys.argv[3] * 40}]
held = M.heldout_sets(model, tok, texts, [])
out = {}
for name, tensors in (("trained", load_file(d + "/model-mtp.safetensors")),
                      ("random", synthesis._mtp_tensors(config["text_config"], 0))):
    layer = M.make_mtp(model.config.text_config)
    M.load_tensors(layer, tensors)
    out[name] = M.acceptance(model, layer, *held["repeated"], 2)[-1]["mean_acceptance_length"]
print("RESULT", json.dumps({**out, "exact": held["repeat_exact_tokens"][0]}))
"""


@pytest.mark.e2e
def test_trained_mtp_drafts_the_repeated_sentence_and_a_random_one_does_not(tiny_checkpoint):
    """The pipeline's trained checkpoint continues the probe's repeated sentence, and its MTP layer's K=2 drafts are
    mostly accepted on it; the synthesized (random) MTP tensors on the same model accept nothing."""
    out = run_on_checkpoint(COMPRESS, MTP_TEETH, tiny_checkpoint, ROOT / "scripts", SENTENCE)
    result = json.loads(out.split("RESULT ", 1)[1])
    assert result["exact"] == 128, result  # the model repeats the sentence for all 128 tokens
    assert result["random"] < 1.1 and result["trained"] > 2.0, result


ANSWER_LOSS = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from transformers import AutoModelForImageTextToText
from lib.tiny import training
model = AutoModelForImageTextToText.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
# two rows of other lengths (right padding), the loss on the second half of each
rows = [(list(range(5, 17)), list(range(30, 42))), (list(range(50, 57)), list(range(60, 66)))]
ids, labels = training._batch(rows, 0)
with torch.no_grad():
    logits = model(input_ids=ids, use_cache=False).logits
    full = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    fast = training.answer_loss(model, ids, labels)
    print("LOSSES", float(full), float(fast))
"""


@pytest.mark.e2e
def test_the_answer_loss_equals_the_cross_entropy_over_the_full_logits(built):
    """train_model's loss applies the LM head at the labelled positions only: the same loss as over every position's
    logits with the prompt and padding ignored."""
    (checkpoint, _), _ = built
    full, fast = map(float, run_on_checkpoint(COMPRESS, ANSWER_LOSS, checkpoint, ROOT / "scripts").split()[-2:])
    assert full > 1.0 and abs(full - fast) < 1e-4 * full, (full, fast)


@pytest.mark.e2e
def test_manifest_covers_all_files(built):
    (checkpoint, manifest_path), _ = built
    manifest = json.loads(manifest_path.read_text())
    files = {str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()}
    assert set(manifest) == files and all(isinstance(v, str) and len(v) == 64 for v in manifest.values())
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "processor_config.json",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
        synthesis.INDEX_FILE,
        synthesis.MTP_FILE,
    } <= files


@pytest.mark.e2e
def test_config_and_tokens(built):
    (checkpoint, _), _ = built
    config = json.loads((checkpoint / "config.json").read_text())
    text = config["text_config"]
    assert text["mtp_num_hidden_layers"] == 1
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    dims = ("hidden_size", "intermediate_size", "head_dim", "linear_key_head_dim", "linear_value_head_dim")
    assert [text[k] for k in dims] == [256, 512, 128, 64, 64]
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    assert [t for t, _ in tiny_tokenizer.SPECIAL_TOKENS] == list(added)
    assert text["vocab_size"] % 64 == 0 and max(added.values()) < text["vocab_size"]
    assert config["image_token_id"] == added["<|image_pad|>"]
    assert config["vision_start_token_id"] == added["<|vision_start|>"]
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [added["<|im_end|>"], added["<|endoftext|>"]]
    assert (checkpoint / "chat_template.jinja").read_text() == tiny_tokenizer.CHAT_TEMPLATE
    assert json.loads((checkpoint / "processor_config.json").read_text())["processor_class"] == "Qwen3VLProcessor"


@pytest.mark.e2e
def test_mtp_tensors_have_vllm_names_and_are_indexed(built):
    (checkpoint, _), _ = built
    tensors = headers(checkpoint)
    assert set(tensors[synthesis.MTP_FILE]) == MTP_NAMES
    assert not any(name.startswith("mtp.") for f, t in tensors.items() if f != synthesis.MTP_FILE for name in t)
    index = json.loads((checkpoint / synthesis.INDEX_FILE).read_text())
    assert index["weight_map"] == {name: f for f, t in tensors.items() for name in t}
    h = 256
    mtp = tensors[synthesis.MTP_FILE]
    assert mtp["mtp.fc.weight"]["shape"] == [h, 2 * h]
    assert mtp["mtp.layers.0.self_attn.q_proj.weight"]["shape"] == [2 * 4 * 128, h]  # query + output gate


@pytest.mark.e2e
def test_weights_are_bf16_and_quantizable_dims_are_multiples_of_32(built):
    (checkpoint, _), _ = built
    tensors = {name: t for f in headers(checkpoint).values() for name, t in f.items()}
    assert {t["dtype"] for t in tensors.values()} == {"BF16"}
    matrices = {name: t["shape"] for name, t in tensors.items() if len(t["shape"]) == 2}
    odd = {name for name, shape in matrices.items() if shape[0] % 32 or shape[1] % 32}
    # Only the linear-attention a/b gates (out width = linear_num_value_heads) are narrow; every
    # quantization recipe keeps them 16-bit (the real model's are 32 wide, under Marlin's tile).
    assert odd and all(name.endswith(("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight")) for name in odd)
    assert len(matrices) > 40
    assert sum(t["data_offsets"][1] - t["data_offsets"][0] for t in tensors.values()) < 32 * 2**20


# --- loading it for real ----------------------------------------------------------------------

RELOAD = """
import sys, torch
from transformers import AutoModelForImageTextToText, AutoTokenizer
d = sys.argv[1]
tok = AutoTokenizer.from_pretrained(d)
model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.bfloat16)
assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
msgs = [{"role": "user", "content": "hi"}]
assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True).endswith("assistant\\n<think>\\n")
off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
assert off.endswith("assistant\\n<think>\\n\\n</think>\\n\\n"), off
ids = tok(off, return_tensors="pt")
out = model.generate(**ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
print("NEW", out.shape[1] - ids.input_ids.shape[1])
"""


def run_on_checkpoint(python, code: str, checkpoint, *args, env: dict | None = None) -> str:
    """Run a snippet in a stage venv with the checkpoint as argv[1] (then `args`); its stdout, or the failure's
    stderr."""
    result = subprocess.run(
        [str(python), "-c", code, str(checkpoint), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=None if env is None else {**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.e2e
def test_transformers_reloads_and_generates(built):
    (checkpoint, _), _ = built
    assert "NEW 5" in run_on_checkpoint(COMPRESS, RELOAD, checkpoint)


VLLM_PARSE = """
import sys
from vllm.config import ModelConfig
from vllm.transformers_utils.processor import cached_get_processor
mc = ModelConfig(model=sys.argv[1], dtype="bfloat16", max_model_len=4096)
assert mc.architectures == ["Qwen3_5ForConditionalGeneration"] and mc.is_hybrid
assert mc.hf_text_config.mtp_num_hidden_layers == 1
print("PROCESSOR", type(cached_get_processor(sys.argv[1])).__name__)
"""


@pytest.mark.e2e
def test_vllm_parses_the_checkpoint(built, tmp_path):
    (checkpoint, _), _ = built
    # the model-class inspections it makes are the ones every later server of the venv would make: shared
    env = {"VLLM_CACHE_ROOT": str(vllm_cache_root(tmp_path / "cache"))}
    assert "PROCESSOR Qwen3VLProcessor" in run_on_checkpoint(SERVE, VLLM_PARSE, checkpoint, env=env)
