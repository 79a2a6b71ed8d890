"""download and train_tiny: hub pinning/failure handling, the hub's own hashes (checked for real by huggingface_hub
against a local stand-in of the hub, tests/support/hub_standin.py), the manifest check of a later run, the synthetic
tiny checkpoint, its chat template and its training.

Quick tests run under plain python3 (no torch). Building the tiny checkpoint runs the stage in the
compress venv through a subprocess (built by the pipeline's venv rule); loading it in transformers
and vLLM is e2e.
"""

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

import download
import quantize
import train_tiny
from conftest import ROOT, TEST_TORCH_THREADS, vllm_cache_root
from hub_standin import StandinHub, git_blob_sha1 as blob_sha1_of, run_stage_script
from lib import hub
from lib.checkpoint import verify_manifest
from lib.safetensors import read_header
from lib.stage import StageError, sha256_file, validate_json
from lib.tiny import synthesis, tokenizer as tiny_tokenizer, training

COMPRESS = ROOT / ".venvs" / "compress" / "bin" / "python"
SERVE = ROOT / ".venvs" / "serve-cpu" / "bin" / "python"
CORPUS = ROOT / "data" / "tiny" / "corpus.txt"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
GENERATOR = ROOT / "scripts" / "lib" / "tiny" / "tasks.py"

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


def job(tmp_path, source="hub", revision=COMMIT, tiny=None, corpus=None):
    inputs = {"venv": ".venvs/compress/pip-freeze.txt"}
    if corpus:
        inputs["corpus"] = str(corpus)
    return SimpleNamespace(
        rule="download",
        input=SimpleNamespace(**inputs),
        log=[],
        threads=1,
        params=SimpleNamespace(source=source, repo="Qwen/Qwen3.5-4B", revision=revision, tiny=tiny),
        output=SimpleNamespace(
            checkpoint=str(tmp_path / "weights" / "m" / "checkpoint"),
            manifest=str(tmp_path / "weights" / "m" / "manifest.json"),
        ),
    )


# --- hub --------------------------------------------------------------------------------------


@pytest.mark.parametrize("revision", ["main", "v1.0", COMMIT[:12], COMMIT.upper(), COMMIT + "0", None, ""])
def test_unpinned_revision_is_refused_before_anything_is_written(tmp_path, revision):
    with pytest.raises(StageError, match="Qwen/Qwen3.5-4B.*40-hex"):
        download.main(job(tmp_path, revision=revision))
    assert not (tmp_path / "weights").exists()


def test_offline_hub_names_the_repo_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    stale = tmp_path / "weights" / "m" / "checkpoint"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # a previous run's leftovers must not survive a failure
    with pytest.raises(StageError, match=f"Qwen/Qwen3.5-4B@{COMMIT}.*HF_HUB_OFFLINE"):
        download.main(job(tmp_path))
    assert list((tmp_path / "weights" / "m").iterdir()) == []


def test_hub_errors_become_stage_errors_and_clean_up(tmp_path, monkeypatch):
    def broken(repo, revision, dest):
        (dest / "model.safetensors").write_bytes(b"half")
        raise StageError(f"could not download {repo}@{revision}")

    monkeypatch.setattr(download, "fetch_hub", broken)
    with pytest.raises(StageError, match="Qwen/Qwen3.5-4B"):
        download.main(job(tmp_path))
    assert list((tmp_path / "weights" / "m").iterdir()) == []


def test_unknown_source_is_refused(tmp_path):
    with pytest.raises(StageError, match="source"):
        download.main(job(tmp_path, source="s3"))


def test_manifest_is_flat_and_covers_every_file(tmp_path, monkeypatch):
    def fake(tiny, corpus, dest, generator=None):
        (dest / "config.json").write_text("{}")
        (dest / "sub").mkdir()
        (dest / "sub" / "w.safetensors").write_bytes(b"\0" * 10)

    monkeypatch.setattr(download, "build_synthetic", fake)
    j = job(tmp_path, source="synthetic", tiny={"seed": 0}, corpus=CORPUS)
    download.main(j)
    manifest = json.loads(Path(j.output.manifest).read_text())
    checkpoint = Path(j.output.checkpoint)
    assert manifest == {
        "config.json": sha256_file(checkpoint / "config.json"),
        "sub/w.safetensors": sha256_file(checkpoint / "sub" / "w.safetensors"),
    }
    assert not checkpoint.with_name("checkpoint.partial").exists()


# --- the hub's own hashes ---------------------------------------------------------------------

CONFIG = b'{"architectures": ["Qwen3_5ForConditionalGeneration"]}\n'
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def safetensors_bytes(values: int = 4) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [values], "data_offsets": [0, 4 * values]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + bytes(range(4 * values))


# what the stand-in hub serves: two small files (git blob sha1) and an LFS one (sha256)
HUB_FILES = {".gitattributes": GITATTRIBUTES, "config.json": CONFIG, "model.safetensors": safetensors_bytes()}
HUB_LFS = {"model.safetensors"}


def hub_listing(files=HUB_FILES, lfs=HUB_LFS) -> dict[str, dict]:
    """What the record must say, computed here from the bytes (not by download's code)."""
    return {
        name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        if name in lfs
        else {"size": len(data), "git_sha1": blob_sha1_of(data)}
        for name, data in files.items()
    }


def flipped(data: bytes) -> bytes:
    """The same length with its last byte changed: huggingface_hub's own size check passes, only a hash tells."""
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def test_git_blob_sha1_is_gits_object_id(tmp_path):
    for data, oid in (
        (b"", "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"),
        (b"hi\n", "45b983be36b73c0788dc9cbcb76cbb80fc7bb057"),
    ):
        (tmp_path / "f").write_bytes(data)
        assert hub.git_blob_sha1(tmp_path / "f") == oid  # `git hash-object f`


def test_hub_hashes_are_the_lfs_sha256_or_the_git_oid():
    lfs = SimpleNamespace(size=99, sha256="a" * 64, pointer_size=130)
    entries = [
        SimpleNamespace(path="model.safetensors", size=99, blob_id="b" * 40, lfs=lfs),  # blob_id: the pointer's
        SimpleNamespace(path="config.json", size=7, blob_id="c" * 40, lfs=None),
        SimpleNamespace(path="sub", tree_id="d" * 40),  # a folder
    ]
    assert hub.hub_hashes(entries) == {
        "model.safetensors": {"size": 99, "sha256": "a" * 64},
        "config.json": {"size": 7, "git_sha1": "c" * 40},
    }


def test_a_file_unlike_the_hubs_hash_is_named_with_both_hashes(tmp_path):
    for name, data in HUB_FILES.items():
        (tmp_path / name).write_bytes(data)
    expected = hub_listing()
    hub.verify_against_hub(tmp_path, expected, "org/m@x")  # as listed: passes
    (tmp_path / "model.safetensors").write_bytes(flipped(HUB_FILES["model.safetensors"]))
    (tmp_path / "config.json").write_bytes(CONFIG.replace(b"Qwen", b"Qwex"))
    (tmp_path / ".gitattributes").unlink()
    (tmp_path / "extra.bin").write_bytes(b"?")
    with pytest.raises(StageError) as error:
        hub.verify_against_hub(tmp_path, expected, "org/m@x")
    message = str(error.value)
    assert message.startswith("org/m@x: the download does not match the hub's own hashes")
    lfs_actual = sha256_file(tmp_path / "model.safetensors")
    small_actual = hub.git_blob_sha1(tmp_path / "config.json")
    assert f"model.safetensors: the hub's LFS sha256 is {expected['model.safetensors']['sha256']}, " in message
    assert f"the downloaded file's is {lfs_actual}" in message
    assert f"config.json: the hub's git blob sha1 is {expected['config.json']['git_sha1']}, " in message
    assert f"the downloaded file's is {small_actual}" in message
    assert ".gitattributes: listed by the hub, not downloaded" in message
    assert "extra.bin: downloaded, not listed by the hub" in message


def fake_hub_module(files: dict[str, bytes], listed: dict[str, bytes], lfs=HUB_LFS):
    """huggingface_hub as download uses it, without a network: the listing describes `listed`; the snapshot writes
    `files` (and the download bookkeeping huggingface_hub leaves in a local_dir)."""

    def entry(name, data):
        listing = hub_listing({name: data}, lfs)[name]
        info = SimpleNamespace(size=len(data), sha256=listing["sha256"]) if "sha256" in listing else None
        return SimpleNamespace(path=name, size=len(data), blob_id=listing.get("git_sha1", "0" * 40), lfs=info)

    class HfApi:
        def list_repo_tree(self, repo, revision, recursive):
            assert revision == COMMIT and recursive
            return iter([entry(name, data) for name, data in listed.items()])

    def snapshot_download(repo_id, revision, local_dir):
        assert revision == COMMIT
        for name, data in files.items():
            (Path(local_dir) / name).write_bytes(data)
        (Path(local_dir) / ".cache" / "huggingface").mkdir(parents=True)
        (Path(local_dir) / ".cache" / "huggingface" / "x.metadata").write_text("bookkeeping")

    return SimpleNamespace(HfApi=HfApi, snapshot_download=snapshot_download)


def test_hub_download_records_the_hubs_hashes_and_keeps_nothing_on_a_mismatch(tmp_path, monkeypatch):
    """download.main's hub path with huggingface_hub replaced (test_hub_path_against_a_local_hub runs the real one)."""
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake_hub_module(HUB_FILES, HUB_FILES))
    j = job(tmp_path)
    j.output.record = str(tmp_path / "weights" / "m" / "download.json")
    download.main(j)
    record = json.loads(Path(j.output.record).read_text())  # schema-checked by the stage
    assert record["hub"] == {"repo": "Qwen/Qwen3.5-4B", "revision": COMMIT, "files": hub_listing()}
    assert json.loads(Path(j.output.manifest).read_text()) == {
        name: hashlib.sha256(data).hexdigest() for name, data in HUB_FILES.items()
    }

    corrupt = {**HUB_FILES, "model.safetensors": flipped(HUB_FILES["model.safetensors"])}
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake_hub_module(corrupt, HUB_FILES))
    with pytest.raises(StageError, match="model.safetensors: the hub's LFS sha256 is"):
        download.main(j)
    assert list((tmp_path / "weights" / "m").iterdir()) == []  # not the last good one either: a rerun fetches


def test_a_hub_record_without_the_hubs_hashes_is_invalid():
    record = {"source": "hub", "training": None, "seconds": 1.0, "files": 3, "bytes": 10}
    with pytest.raises(StageError, match="'hub' is a required property"):
        validate_json(record, download.SCHEMA)
    validate_json({**record, "hub": {"repo": "a/b", "revision": COMMIT, "files": hub_listing()}}, download.SCHEMA)
    with pytest.raises(StageError, match="hub"):
        validate_json(
            {**record, "source": "synthetic", "hub": {"repo": "a/b", "revision": COMMIT, "files": {}}}, download.SCHEMA
        )


def synthetic_download(tmp_path, monkeypatch):
    def fake(tiny, corpus, dest, generator=None):
        (dest / "config.json").write_bytes(CONFIG)
        (dest / "model.safetensors").write_bytes(safetensors_bytes())

    monkeypatch.setattr(download, "build_synthetic", fake)
    j = job(tmp_path, source="synthetic", tiny={"seed": 0}, corpus=CORPUS)
    j.output.record = str(tmp_path / "weights" / "m" / "download.json")
    download.main(j)
    return j


TAMPERINGS = {
    "changed": lambda c: (c / "model.safetensors").write_bytes(flipped((c / "model.safetensors").read_bytes())),
    "removed": lambda c: (c / "config.json").unlink(),
    "added": lambda c: (c / "extra.safetensors").write_bytes(b"?"),
}


@pytest.mark.parametrize("tampering", TAMPERINGS)
def test_a_rerun_does_not_trust_a_checkpoint_changed_since_download(tmp_path, monkeypatch, tampering):
    """Snakemake reruns no stage when a file inside the checkpoint folder changes: the stages that read it (quantize,
    and train_tiny for the tiny model) check it against its manifest first, and refuse it naming the file."""
    j = synthetic_download(tmp_path, monkeypatch)
    checkpoint, manifest = Path(j.output.checkpoint), j.output.manifest
    verify_manifest(checkpoint, manifest)  # as made: trusted
    (checkpoint / ".snakemake_timestamp").write_text("")  # Snakemake's marker on a finished folder is not a change
    verify_manifest(checkpoint, manifest)
    TAMPERINGS[tampering](checkpoint)
    name = {"changed": "model.safetensors: sha256 ", "removed": "config.json: missing", "added": "extra.safetensors"}
    out = tmp_path / "out"
    quantize_job = SimpleNamespace(
        input=SimpleNamespace(model=str(checkpoint), model_manifest=manifest, recipe="unused"),
        output=SimpleNamespace(model=str(out / "model"), manifest=str(out / "manifest.json")),
        params=SimpleNamespace(quantize={}),
    )
    train_job = SimpleNamespace(
        input=SimpleNamespace(checkpoint=str(checkpoint), manifest=manifest, record=j.output.record),
        output=SimpleNamespace(checkpoint=str(out / "checkpoint"), manifest=str(out / "manifest.json")),
        params=SimpleNamespace(seed=0, train={"steps": 2}, sentence=SENTENCE),
    )
    for stage, stage_job in ((quantize, quantize_job), (train_tiny, train_job)):
        with pytest.raises(StageError, match=f"no longer matches its manifest(.|\n)*{name[tampering]}"):
            stage.main(stage_job)
    assert not out.exists()


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


SENTENCE = "The quick brown fox jumps over the lazy dog near the quiet river bank. "
NO_MTP = {
    "repeat_examples": 0,
    "repeat_max_tokens": 64,
    "mtp_steps": 0,
    "mtp_lr": 0.003,
    "mtp_batch_size": 4,
    "mtp_k": 2,
    "mtp_eval_prompts": 2,
}
ACCEPTANCE = [
    {"k": 1, "rounds": 10, "mean_acceptance_length": 1.8, "draft_accuracy": [0.8]},
    {"k": 2, "rounds": 9, "mean_acceptance_length": 2.4, "draft_accuracy": [0.8, 0.6]},
]
TRAINING = {
    "steps": 2,
    "batch_size": 1,
    "lr": 0.1,
    "seed": 0,
    "threads": 1,
    "examples": 3,
    "seconds": 0.5,
    "first_loss": 8.0,
    "final_loss": 1.0,
    "heldout_answer_token_accuracy": 0.5,
    "heldout_examples": 3,
    "repeat_examples": 2,
    "mtp_first_loss": 8.0,
    "mtp_final_loss": 2.0,
    "mtp": {
        "steps": 2,
        "lr": 0.003,
        "batch_size": 1,
        "seed": 0,
        "threads": 1,
        "sequences": 5,
        "seconds": 0.3,
        "first_loss": 8.0,
        "final_loss": 2.0,
        "total_seconds": 1.0,
        "heldout": {
            "repeated_prompts": 1,
            "conversations": 1,
            "prompt_tokens": 64,
            "new_tokens": 128,
            "repeat_exact_tokens": [128],
        },
        "acceptance_untrained": {"repeated": 1.0, "conversation": 1.0},
        "acceptance": {"repeated": ACCEPTANCE, "conversation": ACCEPTANCE},
    },
}


def test_download_records_an_untrained_checkpoint_and_train_tiny_completes_the_record(tmp_path, monkeypatch):
    def fake_build(tiny, corpus, dest, generator=None):
        (dest / "config.json").write_text("{}")

    monkeypatch.setattr(download, "build_synthetic", fake_build)
    j = job(tmp_path / "untrained", source="synthetic", tiny={"seed": 0}, corpus=CORPUS)
    j.output.record = str(tmp_path / "untrained" / "weights" / "m" / "download.json")
    download.main(j)
    record = json.loads(Path(j.output.record).read_text())
    assert record["source"] == "synthetic" and record["training"] is None and record["files"] == 1

    def fake_train(synthesized, dest, seed, settings, generator, sentences):
        assert sentences == [SENTENCE]
        (dest / "config.json").write_text((synthesized / "config.json").read_text())
        (dest / "model.safetensors").write_bytes(b"trained")
        return dict(TRAINING)

    monkeypatch.setattr(train_tiny, "train", fake_train)
    out = tmp_path / "weights" / "m"
    trained = SimpleNamespace(
        rule="train_tiny",
        log=[],
        threads=1,
        input=SimpleNamespace(
            checkpoint=j.output.checkpoint, manifest=j.output.manifest, record=j.output.record, generator="unused"
        ),
        params=SimpleNamespace(seed=0, train={"steps": 2}, sentence=SENTENCE),
        output=SimpleNamespace(
            checkpoint=str(out / "checkpoint"), manifest=str(out / "manifest.json"), record=str(out / "download.json")
        ),
    )
    train_tiny.main(trained)
    final = json.loads((out / "download.json").read_text())
    assert final["training"] == TRAINING and final["files"] == 2 and final["seconds"] >= record["seconds"]
    assert set(json.loads((out / "manifest.json").read_text())) == {"config.json", "model.safetensors"}


def test_train_tiny_refuses_a_synthesized_checkpoint_of_another_seed(tmp_path):
    synthesized, trained = tmp_path / "a", tmp_path / "b"
    for folder, mtp in ((synthesized, b"seed 0"), (trained, b"seed 1")):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(folder.name.encode())  # training may change this one
        (folder / "model-mtp.safetensors").write_bytes(mtp)
    with pytest.raises(StageError, match="model-mtp.safetensors.*seed or dims"):
        train_tiny.check_untrained_parts(synthesized, trained)
    (trained / "model-mtp.safetensors").write_bytes(b"seed 0")
    train_tiny.check_untrained_parts(synthesized, trained)


def test_training_conversations_stay_out_of_the_test_splits():
    generator = training.load_generator(GENERATOR)
    tests = generator.test_docs()
    plan = training.training_plan(
        {
            **NO_MTP,
            "steps": 3,
            "lr": 0.01,
            "batch_size": 2,
            "seed": 0,
            "data_seed": 5,
            "examples": 90,
            "heldout_examples": 9,
            "threads": 1,
            "warmup_steps": 1,
        },
        generator,
    )
    assert len(plan["conversations"]) == 90 and len(plan["heldout"]) == 9
    assert {c["task"] for c in plan["conversations"]} == {"tiny_mc", "tiny_mc_think", "tiny_ifeval"}
    test_texts = {generator.mmlu_pro_text(d) for d in tests["tiny_mc"]}
    test_texts |= {generator.GPQA_TEMPLATE.format(**d) for d in tests["tiny_mc_think"]}
    test_texts |= {d["prompt"] for d in tests["tiny_ifeval"]}
    trained = [c["messages"][-1]["content"] for c in plan["conversations"]]
    assert not test_texts & set(trained)
    assert not {json.dumps(c["messages"]) for c in plan["heldout"]} & {
        json.dumps(c["messages"]) for c in plan["conversations"]
    }
    assert all(c["thinking"] == (c["task"] == "tiny_mc_think") for c in plan["conversations"])


def test_repeated_texts_hold_the_probe_sentence_and_the_heldout_ones_are_new():
    generator = training.load_generator(GENERATOR)
    settings = {
        **NO_MTP,
        "steps": 3,
        "lr": 0.01,
        "batch_size": 2,
        "seed": 0,
        "data_seed": 5,
        "examples": 9,
        "heldout_examples": 6,
        "threads": 1,
        "warmup_steps": 1,
        "repeat_examples": 40,
        "mtp_steps": 5,
        "mtp_eval_prompts": 4,
    }
    plan = training.training_plan(settings, generator, [SENTENCE])
    texts = plan["texts"]
    assert len(texts) == 40 and sum(t["sentence"] == SENTENCE for t in texts) == 10  # a quarter: the probe's
    assert all(t["text"].startswith(t["sentence"] * 3) and t["sentence"].endswith(". ") for t in texts)
    assert len({t["sentence"] for t in texts}) > 25  # made-up ones: copying is learnt from the context
    held = plan["mtp"]["heldout_texts"]
    assert len(held) == 4 and held[0]["sentence"] == SENTENCE
    assert not {t["sentence"] for t in held[1:]} & {t["sentence"] for t in texts}
    assert plan["mtp"]["heldout_conversations"] == plan["heldout"][:4]
    assert (plan["mtp"]["steps"], plan["mtp"]["k"]) == (5, 2)
    assert plan == training.training_plan(settings, generator, [SENTENCE])  # seeded
    assert training.training_plan({**settings, "mtp_steps": 0}, generator, [SENTENCE])["mtp"] is None


def test_batches_group_similar_lengths_and_cover_every_example():
    lengths = [5, 100] * 40 + [50] * 16
    plan = training.batch_order(lengths, batch_size=8, steps=12, seed=3)
    assert len(plan) == 12 and all(len(b) == 8 for b in plan)
    assert plan == training.batch_order(lengths, batch_size=8, steps=12, seed=3)  # seeded
    first_epoch = [i for b in plan[:12] for i in b]
    assert sorted(first_epoch) == list(range(96))  # 96 examples = exactly 12 full batches, each once
    padded = sum(max(lengths[i] for i in b) * len(b) for b in plan)
    assert padded < 0.8 * 12 * 8 * 100  # mixed at random, nearly every batch would pad to 100


# --- pure parts of the tiny model -------------------------------------------------------------


def render(messages, **kwargs):
    """Render the template as transformers does (same sandbox and options)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    return env.from_string(tiny_tokenizer.CHAT_TEMPLATE).render(messages=messages, **kwargs)


USER = [{"role": "user", "content": "What is 2 plus 2?"}]


def test_chat_template_thinks_by_default_and_not_when_disabled():
    prompt = "<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n<|im_start|>assistant\n"
    assert render(USER, add_generation_prompt=True) == prompt + "<think>\n"
    assert render(USER, add_generation_prompt=True, enable_thinking=True) == prompt + "<think>\n"
    assert render(USER, add_generation_prompt=True, enable_thinking=False) == prompt + "<think>\n\n</think>\n\n"
    assert render(USER, add_generation_prompt=False) == prompt[: -len("<|im_start|>assistant\n")]


def test_chat_template_history_system_tools_and_images():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nA cat."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "need a tool",
            "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "rain"},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    text = render(messages, tools=tools, add_generation_prompt=True, enable_thinking=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"name": "weather"' in text
    assert "<|vision_start|><|image_pad|><|vision_end|>What is this?" in text
    assert "old thoughts" not in text  # reasoning before the last user turn is dropped, as Qwen does
    assert "<|im_start|>assistant\nA cat.<|im_end|>" in text
    assert (
        '<think>\nneed a tool\n</think>\n\n\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}'
        "\n</tool_call><|im_end|>"
    ) in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_tiny_config_shape():
    ids = {token: 1000 + i for i, (token, _) in enumerate(tiny_tokenizer.SPECIAL_TOKENS)}
    config = synthesis.tiny_config(ids, 1088)
    text = config["text_config"]
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    # tied at both levels, as Qwen3.5-4B ships (vLLM reads the text config's flag)
    assert text["mtp_num_hidden_layers"] == 1 and text["tie_word_embeddings"] is config["tie_word_embeddings"] is True
    rope = text["rope_parameters"]
    assert sum(rope["mrope_section"]) * 2 == text["head_dim"] * rope["partial_rotary_factor"]
    assert config["image_token_id"] == ids["<|image_pad|>"] and config["video_token_id"] == ids["<|video_pad|>"]
    assert config["vision_config"]["out_hidden_size"] == text["hidden_size"]
    assert synthesis.round_up(2648, 64) == 2688 and synthesis.round_up(2688, 64) == 2688


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
    assert (text["hidden_size"], text["intermediate_size"], text["head_dim"], text["linear_value_head_dim"]) == (
        256,
        512,
        128,
        128,
    )
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
