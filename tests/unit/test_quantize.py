import json
import math
import re
import struct
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from lib.dag.recipe import read_recipe
from lib.quantize.checks import (
    check_heldout,
    check_output,
    checkpoint_modules,
    expected_weight_bytes,
    plan_checkpoint,
    plan_targets,
)
from lib.safetensors import checkpoint_header
from lib.stage import StageError, validate_json
from quantize import _as_chat, load_calibration_texts

RECIPES = ROOT / "recipes"
REPORT_SCHEMA = ROOT / "schemas" / "quantize_report.schema.yaml"
ARCH = "Qwen3_5ForConditionalGeneration"
TINY = yaml.safe_load((ROOT / "config" / "tiny.yaml").read_text())
REAL = yaml.safe_load((ROOT / "config.yaml").read_text())


# ---- calibration ----


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
        {"role": "user", "content": "First sentence here."},
        {"role": "assistant", "content": "And the rest."},
    ]
    user, assistant = _as_chat("one two three four")
    assert (user["content"], assistant["content"]) == ("one two", "three four")


# ---- a Qwen3.5 checkpoint as safetensors headers, written without torch ----


def qwen35_tensors(
    hidden=256,
    inter=512,
    layers=4,
    lin_k_heads=2,
    lin_v_heads=4,
    lin_dim=128,
    heads=4,
    kv_heads=2,
    head_dim=128,
    vocab=2688,
    mtp=True,
    tied=False,
) -> dict[str, list[int]]:
    """Tensor name -> shape of a Qwen3.5 checkpoint (defaults: the tiny profile's dims; tied: no lm_head.weight,
    the head is the embedding, as Qwen3.5-4B ships)."""
    t = {
        **({} if tied else {"lm_head.weight": [vocab, hidden]}),
        "model.language_model.embed_tokens.weight": [vocab, hidden],
        "model.language_model.norm.weight": [hidden],
        "model.visual.blocks.0.attn.qkv.weight": [192, 64],
        "model.visual.blocks.0.mlp.linear_fc1.weight": [128, 64],
        "model.visual.merger.linear_fc1.weight": [256, 256],
        "model.visual.patch_embed.proj.weight": [64, 3, 2, 16, 16],
    }

    def block(prefix, full):
        t[f"{prefix}.input_layernorm.weight"] = [hidden]
        t[f"{prefix}.post_attention_layernorm.weight"] = [hidden]
        for name, shape in {
            "gate_proj": [inter, hidden],
            "up_proj": [inter, hidden],
            "down_proj": [hidden, inter],
        }.items():
            t[f"{prefix}.mlp.{name}.weight"] = shape
        if full:
            for name, shape in {
                "q_proj": [2 * heads * head_dim, hidden],
                "k_proj": [kv_heads * head_dim, hidden],
                "v_proj": [kv_heads * head_dim, hidden],
                "o_proj": [hidden, heads * head_dim],
                "q_norm": [head_dim],
                "k_norm": [head_dim],
            }.items():
                t[f"{prefix}.self_attn.{name}.weight"] = shape
        else:
            qkv = 2 * lin_k_heads * lin_dim + lin_v_heads * lin_dim
            for name, shape in {
                "in_proj_qkv": [qkv, hidden],
                "in_proj_z": [lin_v_heads * lin_dim, hidden],
                "in_proj_a": [lin_v_heads, hidden],
                "in_proj_b": [lin_v_heads, hidden],
                "out_proj": [hidden, lin_v_heads * lin_dim],
                "conv1d": [qkv, 1, 4],
                "norm": [lin_dim],
            }.items():
                t[f"{prefix}.linear_attn.{name}.weight"] = shape

    for i in range(layers):
        block(f"model.language_model.layers.{i}", full=i % 4 == 3)
    if mtp:
        block("mtp.layers.0", full=True)
        t["mtp.fc.weight"] = [hidden, 2 * hidden]
        t["mtp.norm.weight"] = [hidden]
    return t


# Qwen3.5-4B's published dims: the shipped recipes must fit the real model, not only the tiny one.
REAL_DIMS = dict(
    hidden=2560,
    inter=9216,
    layers=32,
    lin_k_heads=16,
    lin_v_heads=32,
    lin_dim=128,
    heads=16,
    kv_heads=4,
    head_dim=256,
    vocab=248320,
)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = {"BF16": 2, "F32": 4, "I32": 4, "I64": 8}[dtype]
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))


def header(**dims) -> dict[str, dict]:
    return {n: {"shape": s, "dtype": "BF16", "bytes": 2 * math.prod(s)} for n, s in qwen35_tensors(**dims).items()}


def modules(**dims) -> dict[str, list[int]]:
    return checkpoint_modules(header(**dims))


def plan(recipe: dict, tied: bool = True, **dims) -> dict:
    """plan_checkpoint as the stage runs it, on a tied (Qwen3.5-4B's layout) or untied checkpoint."""
    text = {"tie_word_embeddings": tied, "vocab_size": dims.get("vocab", 2688)}
    config = {"architectures": [ARCH], "tie_word_embeddings": tied, "text_config": text}
    return plan_checkpoint(recipe, config, header(tied=tied, **dims))


def recipe_file(tmp_path, targets, ignore=("re:^mtp\\.",), architectures=(ARCH,), pipeline=None, **weights) -> Path:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32, **weights}
    recipe = {
        "pipeline": {"architectures": list(architectures), **(pipeline or {})},
        "default_stage": {
            "default_modifiers": {
                "QuantizationModifier": {
                    "ignore": list(ignore),
                    "config_groups": {"group_0": {"targets": list(targets), "weights": weights}},
                }
            }
        },
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


# ---- the shipped recipes ----

EXPECTED = {
    "awq-w4a16-g32-mlp": (12, 4),
    "awq-w4a16-g32-broad": (25, 4),
    "awq-w4a16-g128-broad": (25, 4),  # Machete's group size on Hopper (GPU proof)
    "awq-w4a16-g32-broad-head4": (26, 4),
    "awq-w4a16-g32-broad-head8": (26, None),  # int4 body, int8 head
    "awq-w4a16-g32-broad-head4-vocab131k": (26, 4),  # the real vocabulary pruned: header-planned here
    "gptq-w4a16-g32-sym": (25, 4),
    "w8a16": (25, 8),
    "bf16": (0, None),
}


def test_every_recipe_file_is_covered():
    assert {p.stem for p in RECIPES.glob("*.yaml")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_recipe_targets_what_its_name_says(name):
    count, bits = EXPECTED[name]
    recipe = read_recipe(RECIPES / f"{name}.yaml")
    targeted, matches = plan_targets(dict(recipe, prune_vocab=None), ARCH, modules())
    assert len(targeted) == count and all(matches.values())
    assert recipe["quantize"] is (count > 0)
    head = targeted.pop("lm_head", None)  # only the -head recipes quantize the LM head, and say its bits
    assert (head is not None) is ("-head" in name)
    if head:
        assert head["num_bits"] == int(name.split("-head")[1][0]) and count == 1 + len(targeted)
        assert head["strategy"] == ("group" if head["num_bits"] == 4 else "channel")
        bits = 4
    assert {w["num_bits"] for w in targeted.values()} <= {bits}
    groups = {w["group_size"] for w in targeted.values() if w["strategy"] == "group"}
    assert groups <= {int(name.split("-g")[1].split("-")[0])} if "-g" in name else not groups
    for module in targeted:  # never: narrow linear-attention gates, conv, norms, vision, embeddings, MTP
        assert not any(
            word in module for word in ("in_proj_a", "in_proj_b", "conv1d", "norm", "visual", "embed", "mtp.")
        ), module
    kinds = {m.split(".")[-1] for m in targeted}
    if name.endswith("-mlp"):
        assert kinds == {"gate_proj", "up_proj", "down_proj"}
    elif count:
        assert kinds == {
            "gate_proj",
            "up_proj",
            "down_proj",
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "in_proj_qkv",
            "in_proj_z",
            "out_proj",
        }


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_recipes_fit_the_real_model(name):
    planned = plan(read_recipe(RECIPES / f"{name}.yaml"), tied=True, **REAL_DIMS)  # Qwen3.5-4B ties its head
    per_layer = {"awq-w4a16-g32-mlp": 3 * 32}.get(name, 0 if name == "bf16" else 3 * 32 + 24 * 3 + 8 * 4)
    assert len(planned["targeted"]) == per_layer + ("-head" in name)
    assert planned["tied_head"] and planned["untie"] is ("-head" in name)
    rows = 131072 if name.endswith("-vocab131k") else 248320
    assert planned["header"]["model.language_model.embed_tokens.weight"]["shape"] == [rows, 2560]
    if planned["untie"]:
        assert planned["targeted"]["lm_head"] and planned["header"]["lm_head.weight"]["shape"] == [rows, 2560]


@pytest.mark.parametrize(
    "prune, match",
    [
        ({"size": 2688}, "must be at least 64 and below the checkpoint's 2688 vocabulary rows"),
        ({"size": 32}, "must be at least 64"),
        ({"size": "1k"}, "must be {size: N}"),
        ({"size": 1024, "keep": 1}, "must be {size: N}"),
    ],
)
def test_guard_prune_size_is_checked_before_anything_runs(tmp_path, prune, match):
    path = recipe_file(tmp_path, ["re:.*mlp\\.down_proj$"], pipeline={"prune_vocab": prune})
    with pytest.raises(StageError, match=f"pipeline.prune_vocab.*{re.escape(match)}"):
        plan(read_recipe(path), tied=True)


# ---- a tied LM head (Qwen3.5-4B's layout) ----


def test_a_tied_head_is_untied_only_when_the_recipe_says_so(tmp_path):
    path = recipe_file(tmp_path, ["re:.*mlp\\.down_proj$", "re:.*lm_head$"])
    with pytest.raises(StageError) as error:
        plan(read_recipe(path), tied=True)
    message = str(error.value)
    assert "pipeline.untie_head is not set" in message and "ties its LM head to the input embedding" in message
    assert "'re:.*lm_head$'" in message and str(path) in message
    path = recipe_file(tmp_path, ["re:.*mlp\\.down_proj$", "re:.*lm_head$"], pipeline={"untie_head": True})
    planned = plan(read_recipe(path), tied=True)
    assert planned["untie"] and "lm_head" in planned["targeted"]
    # untied: the head's packed bytes join the checkpoint (int4 g32 of a 2688 x 256 head)
    grown = expected_weight_bytes(planned["header"], planned["targeted"])
    body = expected_weight_bytes(header(tied=True), {m: w for m, w in planned["targeted"].items() if m != "lm_head"})
    assert grown - body == 2688 * 256 // 8 * 4 + 2688 * 8 * 2 + 16
    assert not plan(read_recipe(path), tied=False)["untie"]  # an untied checkpoint: nothing to do


@pytest.mark.parametrize(
    "targets, match",
    [
        (["re:.*mlp\\.down_proj$"], "no target quantizes lm_head"),
        (None, "quantizes nothing"),
    ],
)
def test_untie_head_without_a_quantized_head_is_refused(tmp_path, targets, match):
    if targets is None:
        path = tmp_path / "bf16.yaml"
        path.write_text(f"pipeline: {{architectures: [{ARCH}], untie_head: true}}\n")
    else:
        path = recipe_file(tmp_path, targets, pipeline={"untie_head": True})
    with pytest.raises(StageError, match=f"pipeline.untie_head is set .*{match}"):
        plan(read_recipe(path), tied=True)


def test_untie_head_must_be_a_boolean(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(f"pipeline: {{architectures: [{ARCH}], untie_head: 'yes'}}\n")
    with pytest.raises(StageError, match="pipeline.untie_head must be true or false"):
        read_recipe(path)


def test_every_variant_names_a_shipped_recipe():
    for config in (TINY, REAL):
        for name, variant in config["variants"].items():
            assert (ROOT / variant["recipe"]).is_file(), (name, variant["recipe"])
    assert TINY["variants"][TINY["variant"]]["recipe"] == REAL["variants"][REAL["variant"]]["recipe"]


# ---- guards before anything runs: each one tripped ----


def test_guard_unknown_architecture(tmp_path):
    recipe = read_recipe(recipe_file(tmp_path, ["re:.*mlp\\.down_proj$"], architectures=["LlamaForCausalLM"]))
    with pytest.raises(StageError, match="architecture Qwen3_5ForConditionalGeneration is not one recipe .* knows"):
        plan_targets(recipe, ARCH, modules())


@pytest.mark.parametrize(
    "targets, ignore, pattern",
    [
        (
            ["re:.*mlp\\.down_proj$", "re:.*shared_expert\\.gate_proj$"],
            ["re:^mtp\\."],
            "re:.*shared_expert\\.gate_proj$",
        ),
        (["re:.*mlp\\.down_proj$"], ["re:^mtp\\.", "re:.*vision_tower.*"], "re:.*vision_tower.*"),
    ],
)
def test_guard_pattern_that_matches_nothing_is_named(tmp_path, targets, ignore, pattern):
    recipe = read_recipe(recipe_file(tmp_path, targets, ignore=ignore))
    with pytest.raises(StageError) as error:
        plan_targets(recipe, ARCH, modules())
    assert f"pattern {pattern!r} matches no module" in str(error.value)


def test_guard_class_name_target_is_refused_with_a_hint(tmp_path):
    with pytest.raises(StageError, match="'Linear' matches no module.*class name"):
        plan_targets(read_recipe(recipe_file(tmp_path, ["Linear"])), ARCH, modules())


def test_guard_group_size_must_divide_every_input_dim(tmp_path):
    recipe = read_recipe(recipe_file(tmp_path, ["re:.*mlp\\.(gate|up|down)_proj$"], group_size=384))
    with pytest.raises(StageError) as error:
        plan_targets(recipe, ARCH, modules())
    assert "group size does not divide the input dim" in str(error.value)
    assert "mlp.gate_proj (in 256)" in str(error.value)  # gate/up take 256, down_proj's 512 neither


def test_guard_layers_too_narrow_for_the_gpu_int4_kernel(tmp_path):
    recipe = read_recipe(recipe_file(tmp_path, ["re:.*linear_attn\\.in_proj_(a|b|qkv)$"]))
    with pytest.raises(StageError) as error:
        plan_targets(recipe, ARCH, modules(**REAL_DIMS))
    message = str(error.value)
    assert "too narrow for the GPU int4 kernel" in message and "in_proj_a [32x2560]" in message
    assert "in_proj_qkv" not in message  # 8192x2560 fits


def test_guard_targets_must_be_linear_and_not_mtp(tmp_path):
    with pytest.raises(StageError, match="not Linear layers: .*conv1d"):
        plan_targets(read_recipe(recipe_file(tmp_path, ["re:.*linear_attn\\.conv1d$"])), ARCH, modules())
    with pytest.raises(StageError, match="targets match MTP modules .*add re:\\^mtp"):
        plan_targets(read_recipe(recipe_file(tmp_path, ["re:.*mlp\\.down_proj$"], ignore=["lm_head"])), ARCH, modules())


def test_recipe_must_name_architectures_and_spell_out_its_scheme(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("default_stage: {default_modifiers: {QuantizationModifier: {scheme: W4A16, targets: [Linear]}}}\n")
    with pytest.raises(StageError, match="pipeline.architectures"):
        read_recipe(path)
    path.write_text(f"pipeline: {{architectures: [{ARCH}]}}\n" + path.read_text())
    with pytest.raises(StageError, match="spell the scheme out as config_groups"):
        read_recipe(path)


# ---- guards after: each one tripped on a hand-made checkpoint ----

PACKED = "model.language_model.layers.0.mlp.down_proj"


@pytest.fixture
def written(tmp_path):
    """A source checkpoint (one Linear, 16-bit MTP, tokenizer files) and a correctly quantized copy of it."""
    source, out = tmp_path / "source", tmp_path / "out"
    source.mkdir(), out.mkdir()
    write_safetensors(
        source / "model.safetensors",
        {f"{PACKED}.weight": ("BF16", [256, 512]), "model.language_model.norm.weight": ("BF16", [256])},
    )
    write_safetensors(source / "model-mtp.safetensors", {"mtp.fc.weight": ("BF16", [256, 512])})
    write_safetensors(
        out / "model.safetensors",
        {
            f"{PACKED}.weight_packed": ("I32", [256, 64]),
            f"{PACKED}.weight_scale": ("BF16", [256, 16]),
            f"{PACKED}.weight_shape": ("I64", [2]),
            "model.language_model.norm.weight": ("BF16", [256]),
        },
    )
    write_safetensors(out / "model_mtp.safetensors", {"mtp.fc.weight": ("BF16", [256, 512])})
    for name, text in {
        "tokenizer.json": "{}",
        "tokenizer_config.json": "{}",
        "chat_template.jinja": "{{ x }}",
        "processor_config.json": "{}",
        "config.json": "{}",
    }.items():
        (source / name).write_text(text)
        (out / name).write_text(text if name != "config.json" else '{"quantization_config": {}}')
    (source / ".snakemake_timestamp").write_text("")
    targeted = {PACKED: {"num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": True}}
    expected = expected_weight_bytes(checkpoint_header(source), targeted)
    return source, out, targeted, expected


def test_expected_size_of_a_packed_layer(written):
    source, out, targeted, expected = written
    # int4 packed in int32 (256*512/8*4) + a bf16 scale per group of 32 (256*16*2) + weight_shape, rest unchanged
    assert expected == 256 * 64 * 4 + 256 * 16 * 2 + 16 + 256 * 2 + 256 * 512 * 2


def test_a_good_checkpoint_passes_the_after_guards(written):
    source, out, targeted, expected = written
    checks = check_output(source, out, targeted, expected)
    assert checks["quantized_module_names"] == [PACKED] and checks["mtp_tensors"] == 1
    assert checks["carried_over"] == [
        "chat_template.jinja",
        "processor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]  # no dotfiles, no weights, no config.json


def test_after_guard_quantized_count_must_equal_the_targets(written):
    source, out, targeted, expected = written
    with pytest.raises(StageError, match="1 quantized modules where the recipe targets 2 .*missing: extra"):
        check_output(source, out, {**targeted, "extra": targeted[PACKED]}, expected)


def test_after_guard_mtp_present_and_16_bit(written):
    source, out, targeted, expected = written
    (out / "model_mtp.safetensors").unlink()
    with pytest.raises(StageError, match="MTP tensors not carried over intact \\(missing: mtp.fc.weight"):
        check_output(source, out, targeted, expected)
    write_safetensors(out / "model_mtp.safetensors", {"mtp.fc.weight": ("F32", [256, 512])})
    with pytest.raises(StageError, match="not 16-bit: mtp.fc.weight"):
        check_output(source, out, targeted, expected)


@pytest.mark.parametrize("name", ["processor_config.json", "tokenizer.json", "chat_template.jinja"])
def test_after_guard_files_carried_over_as_they_are(written, name):
    source, out, targeted, expected = written
    (out / name).write_text('{"changed": true}')
    with pytest.raises(StageError, match=f"not carried over from the source as they are: {name}"):
        check_output(source, out, targeted, expected)
    (out / name).unlink()
    with pytest.raises(StageError, match=name):
        check_output(source, out, targeted, expected)


def test_after_guard_a_quantized_head_must_be_untied_in_config(written):
    source, out, targeted, expected = written
    tied = {"tie_word_embeddings": True, "text_config": {"tie_word_embeddings": True}}
    (source / "config.json").write_text(json.dumps(tied))
    # llmcompressor's own untying clears only the top-level flag: vLLM reads the text config's and would
    # serve the 16-bit embedding as the head
    (out / "config.json").write_text(json.dumps({**tied, "tie_word_embeddings": False, "quantization_config": {}}))
    with pytest.raises(StageError, match="should be its own tensor.*text_config.tie_word_embeddings=True"):
        check_output(source, out, targeted, expected, head_quantized=True)
    (out / "config.json").write_text(json.dumps({**tied, "quantization_config": {}}))
    check_output(source, out, targeted, expected)  # a 16-bit head stays tied
    (out / "config.json").write_text(json.dumps({"tie_word_embeddings": False, "quantization_config": {}}))
    with pytest.raises(StageError, match="should be tied to the embedding"):
        check_output(source, out, targeted, expected)


def test_after_guard_size_must_shrink_as_expected(written):
    source, out, targeted, expected = written
    with pytest.raises(StageError, match="bytes where the recipe predicts"):
        check_output(source, out, targeted, int(expected * 0.9))


def test_after_guard_heldout_bounds():
    stats = {"tokens": 900, "top1_agreement": 0.93, "ppl_ratio": 1.04}
    check_heldout(stats, 0.9, 1.1)
    with pytest.raises(StageError, match="agreement with the source 0.9300 < 0.95"):
        check_heldout(stats, 0.95, 1.1)
    with pytest.raises(StageError, match="perplexity ratio to the source 1.0400 > 1.02"):
        check_heldout(stats, 0.9, 1.02)


def test_report_schema_rejects_a_report_that_contradicts_itself():
    minimal = {
        "status": "quantized",
        "quantized": True,
        "recipe": {"path": "r", "sha256": "0" * 64, "architectures": [ARCH], "modifiers": [], "groups": []},
        "architecture": ARCH,
        "calibration": None,
        "quantized_modules": 0,
        "quantized_module_names": [],
        "quantization_config": None,
        "checks": {},
        "source_bytes": 1,
        "output_bytes": 1,
        "size_ratio": 1,
        "output_files": {},
        "head": {"tied_in_source": True, "untied": False, "untie_bytes": 0, "quantized": False},
        "wall_seconds": 0,
        "versions": {},
    }
    with pytest.raises(StageError) as error:
        validate_json(minimal, REPORT_SCHEMA)
    for key in ("quantized_modules", "quantization_config", "calibration", "checks"):
        assert key in str(error.value)
