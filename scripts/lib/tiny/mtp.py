"""The tiny model's MTP (multi-token prediction) layer in torch, trained with Qwen's MTP objective.

It mirrors vLLM's Qwen3_5MultiTokenPredictor (model_executor/models/qwen3_5_mtp.py, the same in vLLM 0.26 and
0.32) and the way its proposer (v1/spec_decode/llm_base_proposer.py) drives it:

- at position t the layer reads the target model's hidden state h_t after the target's final norm (what its LM
  head reads) and the embedding of token t+1: fc(cat[pre_fc_norm_embedding(embed(x_{t+1})),
  pre_fc_norm_hidden(h_t)]) (embedding first), then one full-attention decoder layer at position t (causal over
  the MTP's own earlier positions), then mtp.norm; the target's LM head turns that into the guess for x_{t+2}.
  Embeddings and LM head are the target's (vLLM shares them), so only the `mtp.*` tensors are trained.
- drafting K tokens: step 1 as above from the target's h_t and its sampled token; step k+1 sits at the next
  position and reads the MTP's own normed output of step k as its hidden state and the step-k draft as its token,
  attending to the MTP's keys of the target-computed positions <= t and of the earlier draft steps.

The decoder layer is transformers' Qwen3_5DecoderLayer (full attention, gated query, q/k norms, partial mrope),
built from the checkpoint's own text config, so the tensors keep exactly the names vLLM loads (`mtp.` + name).
"""

from lib.tiny.training import target_hidden

PREFIX = "mtp."


def full_attention_index(text_config) -> int:
    """A full-attention layer index of the main model (the MTP layer's type; the index only names a KV cache)."""
    return list(text_config.layer_types).index("full_attention")


def make_mtp(text_config):
    """The MTP module (float32, zero norms, random Linears: replace with load_tensors)."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    class TinyMTP(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            h, eps = config.hidden_size, config.rms_norm_eps
            assert config.mtp_num_hidden_layers == 1, "one MTP layer"
            self.fc = torch.nn.Linear(2 * h, h, bias=False)
            self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
            self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
            self.layers = torch.nn.ModuleList([Qwen3_5DecoderLayer(config, full_attention_index(config))])
            self.norm = Qwen3_5RMSNorm(h, eps=eps)

        def forward(self, embeds, hidden, position_embeddings, mask):
            """embeds: embed(x_{t+1}), hidden: h_t (both [B, T, h]); mask: additive [B, 1, T, T]. Returns the
            normed output ([B, T, h]): the LM head's input, and the next draft step's hidden state."""
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
            x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=mask)
            return self.norm(x)

    return TinyMTP(text_config)


def load_tensors(mtp, tensors: dict) -> None:
    """The `mtp.*` tensors (as in model-mtp.safetensors) into the module, as float32; every name must match."""
    state = {name[len(PREFIX) :]: t.float() for name, t in tensors.items()}
    missing, unexpected = mtp.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"MTP tensors do not match the layer: missing {missing}, unexpected {unexpected}")


def to_tensors(mtp) -> dict:
    """The module's weights under the checkpoint's names, bf16, contiguous, sorted (model-mtp.safetensors' layout)."""
    import torch

    return {PREFIX + name: t.detach().to(torch.bfloat16).contiguous() for name, t in sorted(mtp.state_dict().items())}


def _text_model(model):
    return model.model.language_model


def causal_mask(valid, dtype):
    """Additive mask [B, 1, T, T] from `valid` [B, 1, T, T] booleans (True: may attend)."""
    import torch

    return torch.zeros(valid.shape, dtype=dtype).masked_fill(~valid, torch.finfo(dtype).min)


def _rope(text, x, positions):
    """(cos, sin) for 1-D `positions`: the text's mrope with its three sections at the same position, as vLLM
    gives a text-only request ([3, B, T] position ids, which every transformers version takes)."""
    return text.rotary_emb(x, positions.expand(3, x.shape[0], -1))


def mtp_logits(model, mtp, ids, hidden):
    """One teacher-forced MTP pass: at position t (0..T-2) from h_t and x_{t+1}; logits for x_{t+2}, [B, T-1, V]."""
    import torch

    text = _text_model(model)
    b, t = ids.shape
    embeds = text.embed_tokens(ids[:, 1:])
    rope = _rope(text, embeds, torch.arange(t - 1))
    mask = causal_mask(torch.ones(t - 1, t - 1, dtype=torch.bool).tril().expand(b, 1, -1, -1), embeds.dtype)
    return model.lm_head(mtp(embeds, hidden[:, :-1], rope, mask))


def draft_chains(model, mtp, ids, hidden, k: int):
    """K-step greedy drafts from every position, as vLLM's proposer makes them: [B, T-1, k] draft ids, where
    [:, t, j] is the guess for x_{t+2+j} after the target produced x_{t+1} at position t.

    All chains run at once: step j adds one query per position t (at position t+j), which attends to the
    MTP keys of positions <= t (computed from the target's hidden states and tokens) and to its own chain's
    earlier steps; the layer is re-run over the growing sequence (causal, so earlier outputs do not change)."""
    import torch

    text = _text_model(model)
    b, t = ids.shape
    n = t - 1
    base_pos = torch.arange(n)
    embeds = [text.embed_tokens(ids[:, 1:])]
    hiddens = [hidden[:, :-1]]
    drafts = []
    for step in range(k):
        m = step + 1  # segments: the target-fed one, then one per earlier draft step
        positions = torch.cat([base_pos + j for j in range(m)])
        # segment i's query for chain c: segment 0 keys <= c, and segments 1..i at chain c itself
        q_seg = torch.arange(m).repeat_interleave(n)
        q_chain = base_pos.repeat(m)
        same = (q_chain[:, None] == q_chain[None, :]) & (q_seg[None, :] >= 1) & (q_seg[None, :] <= q_seg[:, None])
        seg0 = (q_seg[None, :] == 0) & (q_chain[None, :] <= q_chain[:, None])
        valid = (seg0 | same).expand(b, 1, -1, -1)
        e, h = torch.cat(embeds, dim=1), torch.cat(hiddens, dim=1)
        out = mtp(e, h, _rope(text, e, positions), causal_mask(valid, e.dtype))[:, step * n :]
        guess = model.lm_head(out).argmax(-1)
        drafts.append(guess)
        embeds.append(text.embed_tokens(guess))
        hiddens.append(out)
    return torch.stack(drafts, dim=-1)


def _pad(seqs: list[list[int]], pad_id: int):
    """Right-padded ids [B, T] and a validity mask (causal layers never see the padding)."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq)
        valid[row, : len(seq)] = True
    return ids, valid


def mtp_loss(model, mtp, ids, valid):
    """Cross-entropy of the MTP's guess for x_{t+2} (from h_t and x_{t+1}) over every position where it exists."""
    import torch

    with torch.no_grad():
        hidden = target_hidden(model, ids)
    logits = mtp_logits(model, mtp, ids, hidden)[:, :-1]
    labels = ids[:, 2:].masked_fill(~valid[:, 2:], -100)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def train_mtp(
    model,
    mtp,
    sequences: list[list[int]],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    threads: int,
    pad_id: int,
    warmup_steps: int = 10,
    log=print,
) -> dict:
    """Qwen's MTP objective on `sequences` (token ids), the main model frozen: AdamW on the `mtp.*` weights only,
    linear warm-up and cosine decay, seeded and deterministic on CPU (fixed threads and data order)."""
    import torch

    from lib.tiny.training import batch_order, optimize

    torch.set_num_threads(int(threads))
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    model.eval().requires_grad_(False)
    mtp.float().train()
    plan = batch_order([len(s) for s in sequences], batch_size, steps, seed)
    trained = optimize(
        list(mtp.parameters()),
        plan,
        lambda picked: mtp_loss(model, mtp, *_pad([sequences[i] for i in picked], pad_id)),
        lr=lr,
        warmup_steps=warmup_steps,
        tag="tiny mtp",
        log=log,
    )
    mtp.eval()
    return {"steps": steps, "lr": lr, "batch_size": batch_size, "seed": seed, "sequences": len(sequences), **trained}


def greedy_continue(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The main model's greedy continuation of each prompt (transformers' cache: the prompt once, then a token a
    step); prompts of one length run as one batch."""
    import torch

    text = _text_model(model)
    out = {}
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    with torch.no_grad():
        for _, rows in sorted(by_len.items()):
            ids = torch.tensor([prompts[i] for i in rows])
            step = text(input_ids=ids, use_cache=True)
            made = []
            for _ in range(new_tokens):
                made.append(model.lm_head(step.last_hidden_state[:, -1]).argmax(-1))
                step = text(input_ids=made[-1][:, None], past_key_values=step.past_key_values, use_cache=True)
            made = torch.stack(made, dim=1)
            out.update({i: made[r].tolist() for r, i in enumerate(rows)})
    return [out[i] for i in range(len(prompts))]


def acceptance(model, mtp, prompts: list[list[int]], continuations: list[list[int]], k_max: int) -> list[dict]:
    """What speculation with K = 1..k_max MTP drafts would accept on these greedy continuations, per K:
    mean_acceptance_length = 1 + mean accepted drafts per verification (vLLM's `1 + accepted / drafts`), and
    draft_accuracy[j] = the share of rounds whose first j+1 drafts all equal the target's greedy tokens.

    Every position of the continuation starts a round (vLLM starts one after each verification; the mean over
    all positions is the same quantity without that sampling): at position t the target has produced x_{t+1}
    from h_t, the MTP drafts x_{t+2}..x_{t+1+K}, and the drafts count up to the first one that differs."""
    import torch

    accepted = {k: [] for k in range(1, k_max + 1)}
    by_len: dict[int, list[int]] = {}
    for i, (p, c) in enumerate(zip(prompts, continuations, strict=True)):
        by_len.setdefault((len(p), len(c)), []).append(i)
    with torch.no_grad():
        for (p_len, c_len), rows in sorted(by_len.items()):  # one batch per shape
            ids = torch.tensor([prompts[i] + continuations[i] for i in rows])
            drafts = draft_chains(model, mtp, ids, target_hidden(model, ids), k_max)  # [B, T-1, k_max]
            for k in accepted:
                for t in range(p_len - 1, p_len + c_len - 1 - k):
                    match = (drafts[:, t, :k] == ids[:, t + 2 : t + 2 + k]).long()
                    accepted[k] += match.cumprod(1).sum(1).tolist()
    out = []
    for k, counts in accepted.items():
        rounds = max(1, len(counts))
        out.append(
            {
                "k": k,
                "rounds": len(counts),
                "mean_acceptance_length": round(1 + sum(counts) / rounds, 4),
                "draft_accuracy": [round(sum(c > j for c in counts) / rounds, 4) for j in range(k)],
            }
        )
    return out


PROMPT_TOKENS, NEW_TOKENS, ANSWER_TOKENS = 64, 128, 48  # the probe's short category; a conversation's answer


def heldout_sets(model, tokenizer, texts: list[dict], conversations: list[dict]) -> dict:
    """Held-out (prompt, the main model's greedy continuation) pairs: repeated sentences (the first PROMPT_TOKENS
    of the raw text, NEW_TOKENS continued, as the probe asks) and conversations (chat-template prompt, the answer up
    to <|im_end|>), plus how much of each repetition the main model continued exactly."""
    from lib.tiny.training import encode_conversations

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [tokenizer(t["text"], add_special_tokens=False)["input_ids"] for t in texts]
    prompts = [i[:PROMPT_TOKENS] for i in ids]
    continued = greedy_continue(model, prompts, NEW_TOKENS)
    exact = []
    for ref, got in zip(ids, continued, strict=True):
        same = [a == b for a, b in zip(ref[PROMPT_TOKENS : PROMPT_TOKENS + NEW_TOKENS], got, strict=True)]
        exact.append(same.index(False) if False in same else len(same))
    chat = [p for p, _ in encode_conversations(tokenizer, conversations, 512)]
    answers = [a[: a.index(im_end) + 1] if im_end in a else a for a in greedy_continue(model, chat, ANSWER_TOKENS)]
    return {
        "repeated": (prompts, continued),
        "conversation": (chat, answers),
        "repeat_exact_tokens": exact,
        "texts": [t["sentence"] for t in texts],
    }


def train_and_measure(
    model,
    tokenizer,
    tensors: dict,
    *,
    conversations: list[dict],
    texts: list[dict],
    text_max_len: int,
    seed: int,
    threads: int,
    steps: int,
    lr: float,
    batch_size: int,
    k: int,
    heldout_texts: list[dict],
    heldout_conversations: list[dict],
    warmup_steps: int = 10,
    log=print,
) -> tuple[dict, dict]:
    """Trains the MTP layer (starting from `tensors`, the synthesized ones) on the main model's training
    sequences, the main model frozen; measures acceptance per K before and after on held-out prompts.
    Returns (the trained `mtp.*` tensors, the record's `mtp` entry)."""
    import time

    import torch

    from lib.tiny.training import encode_conversations, encode_texts

    start = time.monotonic()
    torch.set_num_threads(int(threads))
    torch.use_deterministic_algorithms(True)
    model.float().eval().requires_grad_(False)
    for param in model.parameters():  # the weights as saved (bf16): the hidden states the served model gives
        param.data = param.data.to(torch.bfloat16).float()
    mtp = make_mtp(model.config.text_config)
    load_tensors(mtp, tensors)
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    sequences = [
        p + a
        for p, a in encode_conversations(tokenizer, conversations, 512)
        + encode_texts(tokenizer, texts, text_max_len, seed)
    ]
    held = heldout_sets(model, tokenizer, heldout_texts, heldout_conversations)
    before = {name: acceptance(model, mtp, *held[name], 1) for name in ("repeated", "conversation")}
    stats = train_mtp(
        model,
        mtp,
        sequences,
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        seed=seed,
        threads=threads,
        pad_id=pad_id,
        warmup_steps=warmup_steps,
        log=log,
    )
    after = {name: acceptance(model, mtp, *held[name], k) for name in ("repeated", "conversation")}
    record = {
        **stats,
        "threads": int(threads),
        "heldout": {
            "repeated_prompts": len(heldout_texts),
            "conversations": len(heldout_conversations),
            "prompt_tokens": PROMPT_TOKENS,
            "new_tokens": NEW_TOKENS,
            "repeat_exact_tokens": held["repeat_exact_tokens"],
        },
        "acceptance_untrained": {name: rows[0]["mean_acceptance_length"] for name, rows in before.items()},
        "acceptance": after,
        "total_seconds": round(time.monotonic() - start, 1),
    }
    return to_tensors(mtp), record
