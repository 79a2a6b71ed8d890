"""The tiny model's tokenizer: byte-level BPE trained on the bundled corpus, with Qwen's pre-tokenizer, added
tokens and a Qwen3.5-style chat template (chat_template.jinja beside this file)."""

import json
from pathlib import Path

# Qwen's added tokens in Qwen's order (the real ids start at 248044); `False` = not special, so
# they stay visible in decoded text (reasoning and tool parsers look for them there).
SPECIAL_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

# Qwen2/3's pre-tokenizer split (what the real tokenizer.json uses before byte-level mapping).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
    r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3.5-style template: thinking ON unless enable_thinking is false, which emits an empty
# think block; past reasoning is only rendered after the last user turn; images/videos become
# vision pad tokens; tools go into the system turn.
DATA_FILES = ("chat_template.jinja",)  # inputs of every rule whose script imports this module (lib/dag/imports.py)
CHAT_TEMPLATE = (Path(__file__).parent / DATA_FILES[0]).read_text(encoding="utf-8")


def train_tokenizer(
    corpus_path: str | Path, vocab_size: int, out_dir: str | Path, extra_text: str = "", pad_to: int | None = None
):
    """Byte-level BPE on `corpus_path` (plus `extra_text`, when given) with Qwen's pre-tokenizer and added
    tokens; saved to out_dir.

    `extra_text` is the quality tasks' fixed wording when the model is trained: like a real tokenizer's,
    their words become single tokens, which halves the prompts a CPU trains on.

    `vocab_size` caps the learned BPE vocabulary (merges stop earlier once no pair occurs twice:
    the bundled corpus gives 2622); Qwen's added tokens come after it, as in the real tokenizer.
    Training is deterministic (no sampling; ties broken by pair order).

    `pad_to` (for a full-size embedding, e.g. 248,320): filler tokens fill the vocabulary up to that
    many ids, added tokens last as in Qwen's. Encoding never yields them (no merge makes them), but
    every id a model can sample decodes to text, so streamed output of a random model is never empty.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    if extra_text:
        lines = Path(corpus_path).read_text(encoding="utf-8").splitlines() + extra_text.splitlines()
        tok.train_from_iterator(lines, trainer)
    else:
        tok.train([str(corpus_path)], trainer)
    if pad_to:
        tok = _pad_vocab(tok, pad_to - len(SPECIAL_TOKENS))
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in SPECIAL_TOKENS])

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=262144,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out_dir)
    return wrapped


def _pad_vocab(tok, size: int):
    """The BPE model's vocabulary grown to `size` ids with fillers: a space plus 3-5 letters (byte-level
    characters that decode as themselves), in a fixed order, skipping strings already learned."""
    from itertools import product
    from string import ascii_lowercase

    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    if len(vocab) > size:
        raise ValueError(f"the learned vocabulary ({len(vocab)}) is already larger than {size}")
    fillers = ("\u0120" + "".join(letters) for n in (3, 4, 5) for letters in product(ascii_lowercase, repeat=n))
    for text in fillers:
        if len(vocab) >= size:
            break
        vocab.setdefault(text, len(vocab))
    return Tokenizer.from_str(json.dumps(data))
