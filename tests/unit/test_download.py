"""download and train_tiny: hub pinning/failure handling, the hub's own hashes, the manifest check of a later run, the
synthetic tiny checkpoint, its chat template and its training.

These run under plain python3 (no torch); tests/e2e/test_download.py builds, trains and loads the tiny checkpoint in
the compress venv, and fetches through huggingface_hub.
"""

import hashlib
import json
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

import download
import quantize
import train_tiny
from conftest import ROOT
from hub_standin import git_blob_sha1 as blob_sha1_of
from lib import hub
from lib.checkpoint import verify_manifest
from lib.stage import StageError, sha256_file, validate_json
from lib.tiny import synthesis, tokenizer as tiny_tokenizer, training

CORPUS = ROOT / "data" / "tiny" / "corpus.txt"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
GENERATOR = ROOT / "scripts" / "lib" / "tiny" / "tasks.py"


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


SENTENCE = "The quick brown fox jumps over the lazy dog near the quiet river bank. "
NO_MTP = {
    "repeat_examples": 0,
    "repeat_max_tokens": 64,
    "mtp_steps": 0,
    "mtp_lr": 0.003,
    "mtp_batch_size": 4,
    "mtp_k": 2,
    "mtp_eval_prompts": 2,
    "task_cycle": ["tiny_mc", "tiny_mc_think", "tiny_ifeval"],
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


# training_plan's settings less the sizes each test picks (examples, heldout_examples): a plan is made, never trained
SMALL_PLAN = {
    **NO_MTP,
    "steps": 3,
    "lr": 0.01,
    "batch_size": 2,
    "seed": 0,
    "data_seed": 5,
    "threads": 1,
    "warmup_steps": 1,
}


def test_training_conversations_stay_out_of_the_test_splits():
    generator = training.load_generator(GENERATOR)
    tests = generator.test_docs()
    plan = training.training_plan({**SMALL_PLAN, "examples": 90, "heldout_examples": 9}, generator)
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


def test_the_task_cycle_splits_the_conversations_and_refuses_a_task_the_generator_lacks():
    generator = training.load_generator(GENERATOR)
    settings = {**SMALL_PLAN, "examples": 60, "heldout_examples": 6}
    cycle = ["tiny_mc", "tiny_ifeval", "tiny_mc", "tiny_ifeval", "tiny_mc_think", "tiny_ifeval"]
    plan = training.training_plan({**settings, "task_cycle": cycle}, generator)
    assert [c["task"] for c in plan["conversations"]] == cycle * 10
    counts = {task: sum(c["task"] == task for c in plan["conversations"]) for task in generator.TRAIN_TASKS}
    assert counts == {"tiny_mc": 20, "tiny_mc_think": 10, "tiny_ifeval": 30}
    assert [c["task"] for c in plan["heldout"]] == cycle
    with pytest.raises(StageError, match=r"'model.tiny.train.task_cycle': tasks \['tiny_mmlu'\]"):
        training.training_plan({**settings, "task_cycle": ["tiny_mc", "tiny_mmlu"]}, generator)


def test_repeated_texts_hold_the_probe_sentence_and_the_heldout_ones_are_new():
    generator = training.load_generator(GENERATOR)
    settings = {
        **SMALL_PLAN,
        "examples": 9,
        "heldout_examples": 6,
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
