"""A tiny, seeded, random-weight model in the exact on-disk format of Qwen/Qwen3.5-4B.

It lets the tiny profile run every real stage (quantize, serve, evaluate) on a CPU machine: the
same architecture class, config keys, tensor names, special tokens, chat template and processor
files as the real checkpoint, only small. Heavy imports stay inside functions: this module is
also imported by the main interpreter (tests of the chat template, the config builder).
"""

import json
import os
from pathlib import Path

# Qwen's added tokens in Qwen's order (the real ids start at 248044); `False` = not special, so
# they stay visible in decoded text (reasoning and tool parsers look for them there).
SPECIAL_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]

# Qwen2/3's pre-tokenizer split (what the real tokenizer.json uses before byte-level mapping).
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
                     r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Qwen3.5-style template: thinking ON unless enable_thinking is false, which emits an empty
# think block; past reasoning is only rendered after the last user turn; images/videos become
# vision pad tokens; tools go into the system turn.
CHAT_TEMPLATE = r"""{%- macro render(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for item in content -%}
            {%- if item is string -%}
                {{- item -}}
            {%- elif item.type == 'image' or 'image' in item or 'image_url' in item -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif item.type == 'video' or 'video' in item -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif 'text' in item -%}
                {{- item.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- render(messages[0].content) + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + render(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = render(message.content) %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {%- set content = content.lstrip('\n') %}
        {%- if loop.index0 > ns.last_query %}
            {{- '<|im_start|>assistant\n<think>\n' + (reasoning | trim) + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for call in message.tool_calls %}
                {%- set fn = call.function if call.function is defined else call %}
                {%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) %}
                {{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' + args + '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""

# Qwen3.5-4B's shape, shrunk. Linear-attention head dims stay 128 (vLLM's CPU kernels refuse
# smaller); every Linear a quantizer may touch has both dims multiples of 32, except
# in_proj_a/in_proj_b whose output width is linear_num_value_heads (kept 16-bit, as in the real
# recipes, where it is 32 wide).
TINY_DIMS = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 32768,
    "mtp_num_hidden_layers": 1,
    "vision_depth": 1,
    "vision_hidden_size": 64,
    "vision_intermediate_size": 128,
    "vision_num_heads": 2,
}

IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}
VIDEO_PROCESSOR = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}

MTP_FILE = "model-mtp.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def train_tokenizer(corpus_path: str | Path, vocab_size: int, out_dir: str | Path, extra_text: str = "",
                    pad_to: int | None = None):
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
    from tokenizers import Regex, Tokenizer, AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    if extra_text:
        lines = Path(corpus_path).read_text(encoding="utf-8").splitlines() + extra_text.splitlines()
        tok.train_from_iterator(lines, trainer)
    else:
        tok.train([str(corpus_path)], trainer)
    if pad_to:
        tok = _pad_vocab(tok, pad_to - len(SPECIAL_TOKENS))
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in SPECIAL_TOKENS])

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        model_max_length=262144, clean_up_tokenization_spaces=False, split_special_tokens=False,
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


def tiny_config(token_ids: dict[str, int], vocab_size: int, **dims) -> dict:
    """config.json of the tiny model (Qwen3.5-4B's keys and layout; sizes from TINY_DIMS)."""
    d = {**TINY_DIMS, **dims}
    assert len(d["layer_types"]) == d["num_hidden_layers"]
    # mrope sections split the rotary half-dim (head_dim * 0.25 / 2) over t/h/w as Qwen does.
    half = int(d["head_dim"] * 0.25) // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]
    text = {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "bos_token_id": None, "dtype": "bfloat16", "eos_token_id": token_ids["<|endoftext|>"],
        "full_attention_interval": 4, "head_dim": d["head_dim"], "hidden_act": "silu",
        "hidden_size": d["hidden_size"], "initializer_range": 0.02,
        "intermediate_size": d["intermediate_size"], "layer_types": list(d["layer_types"]),
        "linear_conv_kernel_dim": d["linear_conv_kernel_dim"],
        "linear_key_head_dim": d["linear_key_head_dim"], "linear_num_key_heads": d["linear_num_key_heads"],
        "linear_num_value_heads": d["linear_num_value_heads"],
        "linear_value_head_dim": d["linear_value_head_dim"], "mamba_ssm_dtype": "float32",
        "max_position_embeddings": d["max_position_embeddings"], "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": d["mtp_num_hidden_layers"], "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": d["num_attention_heads"], "num_hidden_layers": d["num_hidden_layers"],
        "num_key_value_heads": d["num_key_value_heads"], "pad_token_id": None, "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": section, "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000, "rope_type": "default"},
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": vocab_size,
    }
    vision = {
        "deepstack_visual_indexes": [], "depth": d["vision_depth"], "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": d["vision_hidden_size"], "in_channels": 3, "initializer_range": 0.02,
        "intermediate_size": d["vision_intermediate_size"], "model_type": "qwen3_5",
        "num_heads": d["vision_num_heads"], "num_position_embeddings": 2304,
        "out_hidden_size": d["hidden_size"], "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "image_token_id": token_ids["<|image_pad|>"], "model_type": "qwen3_5",
        "text_config": text, "tie_word_embeddings": False,
        "video_token_id": token_ids["<|video_pad|>"], "vision_config": vision,
        "vision_end_token_id": token_ids["<|vision_end|>"], "vision_start_token_id": token_ids["<|vision_start|>"],
    }


def _mtp_tensors(text: dict, seed: int) -> dict:
    """The MTP layer under the names vLLM's Qwen3_5MultiTokenPredictor loads (mtp.* -> model.*):
    fc over [embedding; hidden], its two pre-norms, one full-attention decoder layer, a final norm.
    Norms are zero (Qwen3.5 norms scale by 1 + weight), Linears N(0, initializer_range)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)  # its own stream: independent of the model's init
    h, hd, std = text["hidden_size"], text["head_dim"], text["initializer_range"]
    q, kv, ff = text["num_attention_heads"] * hd, text["num_key_value_heads"] * hd, text["intermediate_size"]
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.layers.0.input_layernorm.weight": (h,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * q, h),  # query and output gate (attn_output_gate)
        "mtp.layers.0.self_attn.k_proj.weight": (kv, h),
        "mtp.layers.0.self_attn.v_proj.weight": (kv, h),
        "mtp.layers.0.self_attn.o_proj.weight": (h, q),
        "mtp.layers.0.self_attn.q_norm.weight": (hd,),
        "mtp.layers.0.self_attn.k_norm.weight": (hd,),
        "mtp.layers.0.post_attention_layernorm.weight": (h,),
        "mtp.layers.0.mlp.gate_proj.weight": (ff, h),
        "mtp.layers.0.mlp.up_proj.weight": (ff, h),
        "mtp.layers.0.mlp.down_proj.weight": (h, ff),
        "mtp.norm.weight": (h,),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
    }
    assert text["mtp_num_hidden_layers"] == 1, "only one MTP layer is generated"
    # on the CPU whatever the default device (the full-size build runs under torch.device("cuda")): the
    # generator is a CPU one, and the bytes stay the same wherever the model itself is made
    return {name: (torch.zeros(shape, device="cpu") if len(shape) == 1
                   else torch.randn(shape, generator=gen, device="cpu") * std)
            .to(torch.bfloat16).contiguous() for name, shape in sorted(shapes.items())}


def build_tiny_checkpoint(out_dir: str | Path, seed: int, tokenizer_dir: str | Path, train: dict | None = None,
                          **dims) -> dict:
    """Seeded random Qwen3_5ForConditionalGeneration (bf16 safetensors) plus tokenizer, processor,
    generation config and the MTP layer, in out_dir, briefly trained when `train` is given (train_model's
    arguments). Same seed, tokenizer and training -> same bytes. Returns {"config", "training"}."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t, _ in SPECIAL_TOKENS}
    config = tiny_config(token_ids, round_up(len(tokenizer), 64), **dims)

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**json.loads(json.dumps(config))))
    mtp = _mtp_tensors(config["text_config"], seed)
    stats = None
    if train:
        stats = train_model(model, tokenizer, **train)  # the MTP layer stays random (not trained)
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(out_dir)
    if Path(tokenizer_dir).resolve() != out_dir.resolve():
        tokenizer.save_pretrained(out_dir)

    # transformers has no MTP module: its tensors go into their own shard, listed in the index
    # (vLLM only reads shards the index names once an index exists).
    save_file(mtp, str(out_dir / MTP_FILE), metadata={"format": "pt"})
    shards = sorted(p.name for p in out_dir.glob("*.safetensors") if p.name != MTP_FILE)
    index_path = out_dir / INDEX_FILE
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        assert shards == ["model.safetensors"], shards
        index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in _safetensors_names(out_dir / shards[0])}}
    index["weight_map"].update({name: MTP_FILE for name in mtp})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index["metadata"]["total_size"] = sum(_safetensors_nbytes(out_dir / f) for f in set(index["weight_map"].values()))
    _write_json(index_path, index)

    # transformers writes its own config.json: put back the keys it does not model (MTP and
    # friends) so the file matches the real checkpoint's.
    saved = json.loads((out_dir / "config.json").read_text())
    saved["text_config"].update({k: v for k, v in config["text_config"].items() if k not in saved["text_config"]})
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        saved[key] = config[key]
    _write_json(out_dir / "config.json", saved)

    _write_json(out_dir / "generation_config.json",
                {**generation_config(token_ids), "transformers_version": saved["transformers_version"]})
    write_processor_files(out_dir)
    for path in out_dir.iterdir():  # safetensors writes 0600; a container user other than root must read them
        path.chmod(0o644)
    return {"config": saved, "training": stats}


def encode_conversations(tokenizer, conversations: list[dict], max_len: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + <|im_end|>) per conversation: the prompt rendered by the checkpoint's own chat
    template with the conversation's enable_thinking, as vLLM renders an lm-eval chat request."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for conv in conversations:
        prompt = tokenizer.apply_chat_template(conv["messages"], tokenize=False, add_generation_prompt=True,
                                               enable_thinking=bool(conv["thinking"]))
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(conv["answer"], add_special_tokens=False)["input_ids"] + [im_end]
        if len(prompt_ids) + len(answer_ids) > max_len:
            raise ValueError(f"training conversation of {len(prompt_ids) + len(answer_ids)} tokens > max_len "
                             f"{max_len}: {conv['messages'][-1]['content'][:80]!r}")
        out.append((prompt_ids, answer_ids))
    return out


def _batch(examples, pad_id: int):
    """Right-padded ids and labels (-100 on prompt and padding): causal layers never see the padding."""
    import torch

    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (prompt, answer) in enumerate(examples):
        ids[row, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[row, len(prompt):len(prompt) + len(answer)] = torch.tensor(answer)
    return ids, labels


def batch_order(lengths: list[int], batch_size: int, steps: int, seed: int, window: int = 8) -> list[list[int]]:
    """`steps` batches of example indices: each epoch shuffled, then sorted by length within windows of
    `window` batches so a batch holds similar lengths (right padding is wasted CPU time), batches shuffled again."""
    import random

    rng = random.Random(seed)
    batches: list[list[int]] = []
    while len(batches) < steps:
        order = rng.sample(range(len(lengths)), len(lengths))
        epoch = []
        for i in range(0, len(order), window * batch_size):
            chunk = sorted(order[i:i + window * batch_size], key=lambda j: lengths[j])
            epoch += [chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size)]
        rng.shuffle(epoch)
        batches += [b for b in epoch if len(b) == batch_size] or epoch
    return batches[:steps]


def train_model(model, tokenizer, *, conversations: list[dict], heldout: list[dict], steps: int,
                lr: float, batch_size: int, seed: int, threads: int, max_len: int = 512,
                warmup_steps: int = 20, device: str = "cpu") -> dict:
    """Supervised fine-tuning of the random model on `conversations` (loss on the answers only), seeded and
    deterministic on CPU (fixed threads, deterministic kernels, fixed data order); returns what it measured.

    AdamW with linear warm-up and cosine decay; `heldout` conversations (not trained on) give a teacher-forced
    answer-token accuracy, a quick proxy for the gate's scores. `device` other than cpu is for experiments
    (learning curves on an accelerator): not deterministic, and not what the pipeline does."""
    import math
    import time

    import torch

    torch.set_num_threads(int(threads))
    torch.use_deterministic_algorithms(device == "cpu")
    torch.manual_seed(seed)
    train = encode_conversations(tokenizer, conversations, max_len)
    held = encode_conversations(tokenizer, heldout, max_len)
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.float().to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    schedule = lambda step: min(1.0, (step + 1) / warmup_steps) * (  # noqa: E731
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, step / max(1, steps)))))
    lr_at = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    plan = batch_order([len(p) + len(a) for p, a in train], batch_size, steps, seed)
    losses = []
    start = time.monotonic()
    for step, picked in enumerate(plan):
        ids, labels = (t.to(device) for t in _batch([train[i] for i in picked], pad_id))
        logits = model(input_ids=ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                 ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        lr_at.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            print(f"[tiny train] step {step + 1}/{steps} loss {loss.item():.4f} "
                  f"({time.monotonic() - start:.0f} s)", flush=True)
    seconds = time.monotonic() - start
    accuracy = answer_accuracy(model, held, pad_id, device)
    model.to("cpu").eval()
    tail = losses[-min(20, len(losses)):]
    return {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "threads": int(threads),
            "examples": len(train), "seconds": round(seconds, 1), "first_loss": round(losses[0], 4),
            "final_loss": round(sum(tail) / len(tail), 4), "heldout_answer_token_accuracy": round(accuracy, 4),
            "heldout_examples": len(held)}


def answer_accuracy(model, examples, pad_id: int, device: str = "cpu", batch_size: int = 32) -> float:
    """Teacher-forced greedy accuracy on answer tokens."""
    import torch

    right = total = 0
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            ids, labels = (t.to(device) for t in _batch(examples[i:i + batch_size], pad_id))
            guess = model(input_ids=ids, use_cache=False).logits[:, :-1].argmax(-1)
            mask = labels[:, 1:] != -100
            right += int(((guess == labels[:, 1:]) & mask).sum())
            total += int(mask.sum())
    return right / max(1, total)


def generation_config(token_ids: dict[str, int]) -> dict:
    """Qwen3.5's sampling defaults (thinking mode), with the tiny tokenizer's ids."""
    eot, im_end = token_ids["<|endoftext|>"], token_ids["<|im_end|>"]
    return {"bos_token_id": eot, "do_sample": True, "eos_token_id": [im_end, eot], "pad_token_id": eot,
            "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def write_processor_files(out_dir: str | Path) -> None:
    """The Qwen3-VL processor: the real checkpoint's two preprocessor files plus the unified
    processor_config.json that transformers 5 writes (vLLM builds the processor for this arch)."""
    out_dir = Path(out_dir)
    _write_json(out_dir / "preprocessor_config.json", {**IMAGE_PROCESSOR, "processor_class": "Qwen3VLProcessor"})
    _write_json(out_dir / "video_preprocessor_config.json", {**VIDEO_PROCESSOR, "processor_class": "Qwen3VLProcessor"})
    _write_json(out_dir / "processor_config.json", {
        "image_processor": IMAGE_PROCESSOR, "processor_class": "Qwen3VLProcessor", "video_processor": VIDEO_PROCESSOR,
    })


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def safetensors_header(path: str | Path) -> dict:
    """Tensor name -> {dtype, shape, data_offsets} without torch (the format is 8 bytes of length + JSON)."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


def _safetensors_names(path: Path) -> list[str]:
    return sorted(safetensors_header(path))


def _safetensors_nbytes(path: Path) -> int:
    return sum(t["data_offsets"][1] - t["data_offsets"][0] for t in safetensors_header(path).values())


def build_tiny(out_dir: str | Path, corpus: str | Path, seed: int = 0, vocab_size: int = 4096,
               train: dict | None = None, tokenizer_extra: str = "", **dims) -> dict:
    """Tokenizer + checkpoint into out_dir (the tiny profile's whole `download`)."""
    train_tokenizer(corpus, vocab_size, out_dir, tokenizer_extra)
    return build_tiny_checkpoint(out_dir, seed, out_dir, train=train, **dims)


if __name__ == "__main__":  # python tiny_model.py OUT_DIR CORPUS [SEED] [VOCAB]
    import sys

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = sys.argv[1:]
    build_tiny(args[0], args[1], *(int(a) for a in args[2:4]))
