"""serving/settings.py: the one table of serve settings, the speculative pass-through, and the schema kept equal."""

import json
import sys

import pytest
import yaml

from conftest import ROOT, SERVE_JSON

sys.path.insert(0, str(ROOT))
from serving import patches  # noqa: E402
from serving.settings import (  # noqa: E402
    SERVE,
    SPECULATIVE_KEYS,
    SPECULATIVE_METHODS,
    SPECULATIVE_REQUIRED,
    SettingsError,
    resolve_patches,
    resolve_serve,
    serve_json,
    speculative_config,
    speculative_problems,
    vllm_args,
)

SCHEMA = yaml.safe_load((ROOT / "schemas" / "config.schema.yaml").read_text())

BASE = SERVE_JSON


def value(args, flag):
    return args[args.index(flag) + 1]


# ---------- the schema and the table agree ----------


def test_schema_serve_section_is_the_table_key_by_key_defaults_included():
    schema = SCHEMA["$defs"]["serve"]["properties"]
    assert list(schema) == list(SERVE), "same keys, same order"
    for key, setting in SERVE.items():
        assert schema[key]["default"] == setting.default, key


def test_schema_patches_are_the_registrys_names_with_its_defaults():
    section = SCHEMA["$defs"]["serve"]["properties"]["patches"]
    assert section["additionalProperties"] is False and section["default"] == SERVE["patches"].default == {}
    assert list(section["properties"]) == list(patches.PATCHES), "same names, same order"
    for name, patch in patches.PATCHES.items():
        prop = section["properties"][name]
        assert prop["type"] == "boolean" and prop["default"] is patch.default, name
        assert f"serving/patches/{name}.py" in prop["description"], name


def test_schema_speculative_section_lists_every_method_and_its_keys():
    section = SCHEMA["$defs"]["speculative"]
    assert section["properties"]["method"]["enum"] == list(SPECULATIVE_METHODS)
    assert list(section["properties"]) == list(SPECULATIVE_KEYS)
    for key, prop in section["properties"].items():
        if key not in ("method", "k"):
            assert prop["default"] is None, f"{key}: null = vLLM's own default, nothing sent"
        methods = [m for m, keys in SPECULATIVE_METHODS.items() if key in keys]
        if methods:
            assert all(m in prop["description"] for m in methods), f"{key}: its description names {methods}"


# ---------- serve.json -> vLLM flags ----------


def test_args_basic():
    args = vllm_args(BASE, "/opt/ml/model")
    assert value(args, "--model") == "/opt/ml/model"
    assert value(args, "--served-model-name") == "Qwen/Qwen3.5-4B"
    assert (value(args, "--host"), value(args, "--port")) == ("0.0.0.0", "8080")
    assert value(args, "--max-model-len") == "1024" and value(args, "--max-num-seqs") == "4"
    assert "--enforce-eager" in args and "--enable-prefix-caching" in args
    assert "--language-model-only" in args
    assert "--speculative-config" not in args
    assert value(args, "--middleware") == "serving.middleware.ThinkingMiddleware"
    assert "--max-num-batched-tokens" not in args and "--gdn-prefill-backend" not in args
    assert not any(arg.endswith("async-scheduling") for arg in args), "null: vLLM decides"


def test_missing_keys_take_the_tables_defaults():
    args = vllm_args({"served_model_name": "m"}, "m")
    assert "--no-enable-prefix-caching" in args and "--language-model-only" in args
    assert value(args, "--max-model-len") == str(SERVE["max_model_len"].default)


def test_args_thinking_off_by_default():
    args = vllm_args({k: v for k, v in BASE.items() if k != "default_thinking"}, "m")
    assert json.loads(value(args, "--default-chat-template-kwargs")) == {"enable_thinking": False}
    args = vllm_args({**BASE, "default_thinking": True}, "m")
    assert json.loads(value(args, "--default-chat-template-kwargs")) == {"enable_thinking": True}


def test_args_mtp_renames_k_and_nothing_else():
    args = vllm_args({**BASE, "enable_prefix_caching": False, "speculative": {"method": "mtp", "k": 3}}, "m")
    assert json.loads(value(args, "--speculative-config")) == {"method": "mtp", "num_speculative_tokens": 3}
    assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args


def test_method_parameters_pass_through_unchanged():
    spec = {"method": "ngram", "k": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    args = vllm_args({**BASE, "speculative": spec}, "m")
    assert json.loads(value(args, "--speculative-config")) == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    suffix = {"method": "suffix", "k": 20, "suffix_decoding_max_tree_depth": 32, "suffix_decoding_min_token_prob": None}
    assert speculative_config(suffix) == {
        "method": "suffix",
        "num_speculative_tokens": 20,
        "suffix_decoding_max_tree_depth": 32,
    }


def test_args_optional_and_extra():
    args = vllm_args(
        {
            **BASE,
            "enforce_eager": False,
            "gpu_memory_utilization": 0.9,
            "max_num_batched_tokens": 8192,
            "enable_chunked_prefill": False,
            "async_scheduling": False,
            "kv_cache_dtype": "fp8",
            "gdn_prefill_backend": "triton",
            "cudagraph_capture_sizes": [1, 2, 4],
            "extra_args": ["--seed", "0", "--disable-log-stats"],
        },
        "m",
        port=9000,
    )
    assert "--no-enforce-eager" in args and value(args, "--port") == "9000"
    assert value(args, "--gpu-memory-utilization") == "0.9"
    assert value(args, "--max-num-batched-tokens") == "8192"
    assert "--no-enable-chunked-prefill" in args and "--no-async-scheduling" in args
    assert value(args, "--kv-cache-dtype") == "fp8" and value(args, "--gdn-prefill-backend") == "triton"
    i = args.index("--cudagraph-capture-sizes")
    assert args[i + 1 : i + 4] == ["1", "2", "4"]
    assert args[-3:] == ["--seed", "0", "--disable-log-stats"]  # last, so they win


def test_args_reject_typos():
    with pytest.raises(SettingsError, match="unknown serve key"):
        vllm_args({**BASE, "max_model_length": 5}, "m")
    with pytest.raises(SettingsError, match="speculative.method"):
        vllm_args({**BASE, "speculative": {"method": "eagle9", "k": 1}}, "m")


def test_capture_sizes_default_to_multiples_of_k_plus_one_on_gpu():
    mtp2 = {**BASE, "enforce_eager": False, "max_num_seqs": 4, "speculative": {"method": "mtp", "k": 2}}
    i = vllm_args(mtp2, "m", cuda=True).index("--cudagraph-capture-sizes")
    assert vllm_args(mtp2, "m", cuda=True)[i + 1 : i + 5] == ["3", "6", "9", "12"]
    assert "--cudagraph-capture-sizes" not in vllm_args(mtp2, "m", cuda=False)  # CPU: no CUDA graphs
    assert "--cudagraph-capture-sizes" not in vllm_args({**mtp2, "enforce_eager": True}, "m", cuda=True)
    assert "--cudagraph-capture-sizes" not in vllm_args({**BASE, "enforce_eager": False}, "m", cuda=True)
    explicit = vllm_args({**mtp2, "cudagraph_capture_sizes": [5]}, "m", cuda=True)
    assert value(explicit, "--cudagraph-capture-sizes") == "5"


# ---------- what a speculative section may hold ----------


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"method": "mtp", "k": 2, "prompt_lookup_max": 4}, "speculative.prompt_lookup_max: method mtp does not take"),
        ({"method": "ngram", "k": 2, "suffix_decoding_max_tree_depth": 4}, "method ngram does not take"),
        ({"method": "ngram", "k": 2}, "speculative.prompt_lookup_max: method ngram needs"),
        ({"method": "dflash", "k": 15}, "speculative.draft: method dflash needs"),
        ({"method": "mtp", "k": 0}, "speculative.k: method mtp needs k >= 1"),
        ({"method": "none", "k": 2}, "speculative.k: k=2 without"),
        ({"method": "medusa", "k": 2}, "speculative.method: unknown method 'medusa'"),
        ({"method": "mtp", "k": 2, "lookahead": 3}, "speculative.lookahead: unknown speculative key"),
    ],
)
def test_speculative_problems_name_the_key_and_the_method(spec, words):
    problems = speculative_problems(spec)
    assert any(words in line for line in problems), problems


def test_a_good_section_has_no_problems_and_nulls_are_not_sent():
    for method in SPECULATIVE_METHODS:
        spec = {"method": method, "k": 0 if method == "none" else 2, **{key: None for key in SPECULATIVE_KEYS[2:]}}
        required_values = {"draft": {"repo": "z-lab/Qwen3.5-4B-DFlash"}, "prompt_lookup_max": 4}
        spec.update({key: required_values[key] for key in SPECULATIVE_REQUIRED.get(method, ())})
        assert speculative_problems(spec) == [], method
        written = serve_json({}, spec)["speculative"]
        assert None not in written.values()


def test_serve_json_is_resolved_and_refuses_unknown_keys():
    written = serve_json({"max_num_seqs": 1}, {"method": "mtp", "k": 1})
    assert written == dict(resolve_serve({"max_num_seqs": 1}), speculative={"method": "mtp", "k": 1})
    assert written["patches"] == {name: patch.default for name, patch in patches.PATCHES.items()}
    with pytest.raises(SettingsError, match="unknown serve key"):
        serve_json({"max_seqs": 1}, {"method": "none", "k": 0})


# ---------- model_runner: a vLLM switch without a flag ----------


@pytest.mark.parametrize("runner, variable", [("v1", "0"), ("v2", "1")])
def test_model_runner_reaches_vllm_through_its_environment_variable_not_a_flag(runner, variable):
    from serving.launch import child_env

    settings = dict(SERVE_JSON, model_runner=runner, speculative={"method": "mtp", "k": 2})
    assert child_env({}, settings)["VLLM_USE_V2_MODEL_RUNNER"] == variable
    assert vllm_args(settings, "/m", cuda=True) == vllm_args(dict(settings, model_runner=None), "/m", cuda=True)
    # null is vLLM's own choice: whatever the environment already says stays
    assert "VLLM_USE_V2_MODEL_RUNNER" not in child_env({}, SERVE_JSON)
    assert child_env({"VLLM_USE_V2_MODEL_RUNNER": "1"}, SERVE_JSON)["VLLM_USE_V2_MODEL_RUNNER"] == "1"


def test_model_runner_v2_is_refused_with_a_method_it_does_not_serve():
    serve_json({"model_runner": "v2"}, {"method": "mtp", "k": 2})
    serve_json({"model_runner": "v2"}, {"method": "ngram", "k": 4, "prompt_lookup_max": 4})  # V2's since vLLM 0.32
    serve_json({"model_runner": "v2"}, {"method": "dflash", "k": 3, "draft": {"repo": "a/b"}})
    serve_json({"model_runner": "v1"}, {"method": "suffix", "k": 4})
    with pytest.raises(SettingsError, match="serve.model_runner: v2 does not serve speculative method suffix"):
        serve_json({"model_runner": "v2"}, {"method": "suffix", "k": 2})
    with pytest.raises(SettingsError, match="unknown serve key"):
        serve_json({"model_runner": "v2", "runner": 2}, {"method": "none", "k": 0})


# ---------- serve.patches: the project's vLLM patches, switched per variant ----------


def test_patches_reach_vllms_processes_as_the_enabled_names_and_never_its_flags():
    from serving.launch import child_env

    spec = {"method": "ngram_gpu", "k": 4, "prompt_lookup_max": 4}
    settings = dict(SERVE_JSON, patches={"gpu_name": False, "draft_padding": False}, speculative=spec)
    enabled = child_env({}, settings)[patches.ENV].split(",")
    assert "gpu_name" not in enabled and "draft_padding" not in enabled and "greedy_rejection" in enabled
    defaults = child_env({patches.ENV: "fork_start"}, SERVE_JSON)[patches.ENV].split(",")  # never a user switch
    assert defaults == [name for name, patch in patches.PATCHES.items() if patch.default]
    assert vllm_args(settings, "/m") == vllm_args(dict(settings, patches={}), "/m")
    assert json.loads(value(vllm_args(settings, "/m"), "--speculative-config")) == {
        "method": "ngram_gpu",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
    }


def test_an_unknown_patch_or_a_switch_that_is_not_a_boolean_is_refused_naming_the_key():
    assert resolve_patches({"fork_start": True})["fork_start"] is True
    with pytest.raises(SettingsError, match=r"serve.patches.pad_drafts: unknown patch; known: \['int4_fallback'"):
        serve_json({"patches": {"pad_drafts": True}}, {"method": "suffix", "k": 4})
    with pytest.raises(SettingsError, match="serve.patches.fork_start: must be true or false, got 'yes'"):
        serve_json({"patches": {"fork_start": "yes"}}, {"method": "none", "k": 0})


def test_the_old_speculative_plugin_keys_are_gone():
    for key in ("pad_drafts", "silent_drafts", "graph_drafter"):
        assert key not in SPECULATIVE_KEYS
        assert speculative_problems({"method": "suffix", "k": 4, key: True}) == [
            f"speculative.{key}: unknown speculative key; known: {list(SPECULATIVE_KEYS)}"
        ]


def test_drafts_are_padded_to_k_with_their_last_token_within_the_context():
    from serving.patches.draft_padding import pad

    sampled = [[7], [8], [], [9]]
    drafts = [[1, 2], [], [], [3]]
    # the third sampled nothing (a partial prefill); the fourth has room for one more token only
    assert pad(drafts, sampled, [10, 10, 10, 97], k=4, max_model_len=100) == [[1, 2, 2, 2], [8, 8, 8, 8], [], [3, 3]]
    assert pad([[1, 2, 3, 4]], [[5]], [10], k=4, max_model_len=100) == [[1, 2, 3, 4]]  # already K: unchanged
    assert pad([[]], [[5]], [99], k=4, max_model_len=100) == [[]]  # at the context limit: nothing to verify


def test_the_padding_plugin_wraps_both_copy_drafters_only_when_switched_on(monkeypatch):
    from serving.patches import draft_padding

    class Proposer:
        max_model_len = 100

        def propose(self, k, sampled, num_tokens, token_ids=None):
            return [[] for _ in sampled]

    monkeypatch.setenv(patches.ENV, "")  # serve.patches.draft_padding: false
    draft_padding.register()  # off: vLLM is not even imported
    wrapped = draft_padding._ngram(Proposer.propose)
    assert wrapped(Proposer(), 3, [[5], []], [10, 10], None) == [[5, 5, 5], []]
