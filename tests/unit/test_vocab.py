"""lib/vocab on a hand-made byte-level BPE tokenizer: what is kept, how ids are renumbered, which merges survive,
and each refusal. The tiny checkpoint's pruning through the stage (real tokenizers, round trips) is test_quantize's."""

import pytest

from lib.quantize.vocab import (
    PruneError,
    byte_symbols,
    plan_kept_ids,
    pruned_header,
    pruned_tokenizer,
    remap_added_tokens_decoder,
    remap_token_ids,
    required_texts,
    vocab_sized_tensors,
)

BYTES = byte_symbols()
# ids 0..255 the bytes, then merges in rank order; "Ġt" + "he" -> "Ġthe" needs both parts
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("a", "b"), ("ab", "c"), ("x", "y")] + [
    (a, b) for a, b in zip("defgh", "ijklm", strict=True)
]


def toy_tokenizer() -> dict:
    vocab = {s: i for i, s in enumerate(BYTES)}
    for a, b in MERGES:
        vocab.setdefault(a + b, len(vocab))
    for i in range(len(vocab), 320):  # filler ids up to 320, as a real tokenizer has more than it needs here
        vocab[f"<fill{i}>"] = i
    return {
        "model": {"type": "BPE", "vocab": vocab, "merges": [list(m) for m in MERGES]},
        "decoder": {"type": "ByteLevel"},
        "added_tokens": [{"id": 320, "content": "<|endoftext|>"}, {"id": 321, "content": "<|im_start|>"}],
        "post_processor": {"type": "TemplateProcessing", "special_tokens": {"<|im_start|>": {"ids": [321]}}},
    }


def test_byte_symbols_are_gpt2s_256():
    assert len(set(BYTES)) == 256 and BYTES[ord("a")] == "a" and BYTES[ord(" ")] == "Ġ" and BYTES[10] == "Ċ"


def test_kept_ids_hold_specials_bytes_required_tokens_and_their_pieces():
    tok = toy_tokenizer()
    vocab = tok["model"]["vocab"]
    kept = plan_kept_ids(tok, 320, {vocab["Ġthe"], vocab["abc"]}, vocab_rows=384)
    assert len(kept) == 320 and kept == sorted(kept)
    assert {320, 321} <= set(kept) and set(range(256)) <= set(kept)
    for token in ("Ġthe", "Ġt", "he", "abc", "ab"):  # the required tokens and every piece they merge from
        assert vocab[token] in kept, token
    # filled with the lowest ids after that: the earliest merges
    assert vocab["xy"] in kept


def test_a_token_is_never_kept_without_its_pieces():
    tok = toy_tokenizer()
    vocab = tok["model"]["vocab"]
    kept = set(plan_kept_ids(tok, 320, set(), vocab_rows=384))
    for a, b in MERGES:
        if vocab[a + b] in kept:
            assert vocab[a] in kept and vocab[b] in kept, (a, b)


def test_pruned_tokenizer_renumbers_in_order_and_drops_merges_of_dropped_tokens():
    tok = toy_tokenizer()
    vocab = tok["model"]["vocab"]
    kept = [i for i in sorted(set(vocab.values()) | {320, 321}) if i != vocab["abc"]][:256] + [
        vocab["ab"],
        vocab["Ġt"],
        vocab["he"],
        vocab["Ġthe"],
        320,
        321,
    ]
    kept = sorted(set(kept))
    out = pruned_tokenizer(tok, kept)
    assert sorted(out["model"]["vocab"].values()) == list(range(len(kept) - 2))  # the two added tokens follow
    assert out["model"]["vocab"]["Ġthe"] == kept.index(vocab["Ġthe"])
    assert "abc" not in out["model"]["vocab"] and ["ab", "c"] not in out["model"]["merges"]
    assert ["Ġt", "he"] in out["model"]["merges"] and ["a", "b"] in out["model"]["merges"]
    assert [t["id"] for t in out["added_tokens"]] == [len(kept) - 2, len(kept) - 1]
    assert out["post_processor"]["special_tokens"]["<|im_start|>"]["ids"] == [len(kept) - 1]
    assert tok["model"]["vocab"]["abc"] == vocab["abc"]  # the input is left as it was


@pytest.mark.parametrize(
    "size, rows, match",
    [
        (300, 384, "multiple of 64"),
        (384, 512, "larger than the tokenizer's 322 ids"),
        (256, 384, "smaller than the 258 ids that must survive"),
        (320, 320, "does not shrink the checkpoint's 320"),
    ],
)
def test_sizes_that_cannot_work_are_refused_naming_why(size, rows, match):
    with pytest.raises(PruneError, match=match):
        plan_kept_ids(toy_tokenizer(), size, set(), vocab_rows=rows)


def test_only_byte_level_bpe_is_pruned():
    tok = toy_tokenizer()
    tok["decoder"] = {"type": "Metaspace"}
    with pytest.raises(PruneError, match="byte-level"):
        plan_kept_ids(tok, 320, set(), vocab_rows=384)
    tok = toy_tokenizer()
    tok["model"]["type"] = "Unigram"
    with pytest.raises(PruneError, match="only BPE"):
        plan_kept_ids(tok, 320, set(), vocab_rows=384)


def test_token_id_fields_are_renumbered_and_a_dropped_one_is_named():
    new_id = {320: 5, 321: 6, 7: 1}
    config = {"image_token_id": 321, "text_config": {"eos_token_id": 320, "bos_token_id": None, "vocab_size": 9}}
    out = remap_token_ids(config, new_id, "config.json")
    assert out == {"image_token_id": 6, "text_config": {"eos_token_id": 5, "bos_token_id": None, "vocab_size": 9}}
    assert remap_token_ids({"eos_token_id": [320, 7]}, new_id, "g")["eos_token_id"] == [5, 1]
    with pytest.raises(PruneError, match="generation_config.json: pad_token_id names ids \\[99\\]"):
        remap_token_ids({"pad_token_id": 99}, new_id, "generation_config.json")
    decoder = remap_added_tokens_decoder({"added_tokens_decoder": {"320": {"content": "<|endoftext|>"}}}, new_id)
    assert decoder == {"added_tokens_decoder": {"5": {"content": "<|endoftext|>"}}}


def test_only_one_row_per_id_tensors_are_sliced():
    header = {
        "model.language_model.embed_tokens.weight": {"shape": [384, 8], "bytes": 384 * 8 * 2},
        "lm_head.weight": {"shape": [384, 8], "bytes": 384 * 8 * 2},
        "model.language_model.layers.0.mlp.up_proj.weight": {"shape": [384, 8], "bytes": 384 * 8 * 2},
        "model.language_model.norm.weight": {"shape": [8], "bytes": 16},
    }
    assert vocab_sized_tensors(header, 384) == ["lm_head.weight", "model.language_model.embed_tokens.weight"]
    smaller = pruned_header(header, 384, 320)
    assert smaller["lm_head.weight"] == {"shape": [320, 8], "bytes": 320 * 8 * 2}
    assert (
        smaller["model.language_model.layers.0.mlp.up_proj.weight"]
        == header["model.language_model.layers.0.mlp.up_proj.weight"]
    )


def test_required_texts_read_plain_files_json_lines_and_the_sentence(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "t.jsonl").write_text('{"q": "question?", "choices": ["yes", "no"], "n": 3}\n\n')
    texts = required_texts([str(tmp_path / "a.txt"), str(tmp_path / "t.jsonl")], "Hi. ")
    assert texts == ["plain text", "question?", "yes", "no", "Hi. Hi. Hi. Hi. "]
