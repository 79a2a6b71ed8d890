"""The tiny model's brief supervised training on generated conversations in the quality tasks' formats
(scripts/lib/tiny/tasks.py), seeded and deterministic on CPU."""

from pathlib import Path

from lib.stage import StageError


def load_generator(path: str | Path):
    """The tiny tasks' generator module (scripts/lib/tiny/tasks.py): it writes the test splits and the
    training conversations, so both come from one place in the same formats."""
    import importlib.util

    path = Path(path)
    if not path.is_file():
        raise StageError(f"tiny training data generator {path} not found")
    spec = importlib.util.spec_from_file_location("tiny_tasks_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def training_plan(train: dict, generator, sentences: list[str] = ()) -> dict | None:
    """train_model's arguments from the config's `model.tiny.train` (None when steps is 0: a random model), with
    the MTP layer's (`mtp`, None when mtp_steps is 0). `sentences`: the latency probe's repeated sentence(s), a
    share of the repeated-text examples."""
    if int(train["steps"]) <= 0:
        return None
    tests = generator.test_docs()
    seed = int(train["data_seed"])
    cycle = tuple(train["task_cycle"])
    try:
        conversations = generator.train_conversations(seed, int(train["examples"]), tests, cycle=cycle)
        heldout = generator.train_conversations(
            seed + 1, int(train["heldout_examples"]), tests, exclude=conversations, cycle=cycle
        )
    except ValueError as error:
        raise StageError(f"config key 'model.tiny.train.task_cycle': {error}") from error
    texts = generator.repeated_texts(seed, int(train["repeat_examples"]), list(sentences))
    plan = {
        "conversations": conversations,
        "heldout": heldout,
        "texts": texts,
        "text_max_len": int(train["repeat_max_tokens"]),
        "steps": int(train["steps"]),
        "lr": float(train["lr"]),
        "batch_size": int(train["batch_size"]),
        "seed": int(train["seed"]),
        "threads": int(train["threads"]),
        "warmup_steps": int(train["warmup_steps"]),
        "mtp": None,
    }
    if int(train["mtp_steps"]) > 0:
        n = int(train["mtp_eval_prompts"])
        # held-out prompts: the probe's sentence(s) first, then made-up sentences never trained on
        made_up = [
            t
            for t in generator.repeated_texts(seed + 1, n + len(sentences))
            if t["sentence"] not in {x["sentence"] for x in texts}
        ]
        plan["mtp"] = {
            "steps": int(train["mtp_steps"]),
            "lr": float(train["mtp_lr"]),
            "batch_size": int(train["mtp_batch_size"]),
            "k": int(train["mtp_k"]),
            "heldout_texts": (generator.repeated_texts(seed, len(sentences), list(sentences), share=1.0) + made_up)[:n],
            "heldout_conversations": heldout[:n],
        }
    return plan


def encode_texts(tokenizer, texts: list[dict], max_len: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(first sentence's ids, the rest) per raw repeated text (no chat template: the probe sends a bare prompt),
    cut to a seeded length between max_len / 3 and max_len tokens; the loss is on the repetitions."""
    import random

    rng = random.Random(seed)
    out = []
    for text in texts:
        ids = tokenizer(text["text"], add_special_tokens=False)["input_ids"]
        first = len(tokenizer(text["sentence"].rstrip(), add_special_tokens=False)["input_ids"])
        if len(ids) < max_len:
            raise ValueError(f"repeated text of {len(ids)} tokens < {max_len}: {text['sentence']!r}")
        cut = rng.randint(max(max_len // 3, first + 2), max_len)
        out.append((ids[:first], ids[first:cut]))
    return out


def encode_conversations(tokenizer, conversations: list[dict], max_len: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + <|im_end|>) per conversation: the prompt rendered by the checkpoint's own chat
    template with the conversation's enable_thinking, as vLLM renders an lm-eval chat request."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for conv in conversations:
        prompt = tokenizer.apply_chat_template(
            conv["messages"], tokenize=False, add_generation_prompt=True, enable_thinking=bool(conv["thinking"])
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(conv["answer"], add_special_tokens=False)["input_ids"] + [im_end]
        if len(prompt_ids) + len(answer_ids) > max_len:
            raise ValueError(
                f"training conversation of {len(prompt_ids) + len(answer_ids)} tokens > max_len "
                f"{max_len}: {conv['messages'][-1]['content'][:80]!r}"
            )
        out.append((prompt_ids, answer_ids))
    return out


def _batch(examples, pad_id: int):
    """Right-padded ids and labels (-100 on prompt and padding): causal layers never see the padding."""
    import torch

    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (prompt, answer) in enumerate(examples):
        ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[row, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
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
            chunk = sorted(order[i : i + window * batch_size], key=lambda j: lengths[j])
            epoch += [chunk[k : k + batch_size] for k in range(0, len(chunk), batch_size)]
        rng.shuffle(epoch)
        batches += [b for b in epoch if len(b) == batch_size] or epoch
    return batches[:steps]


def target_hidden(model, ids):
    """The main model's hidden states after its final norm (what its LM head and vLLM's MTP read), [B, T, h]."""
    return model.model.language_model(input_ids=ids, use_cache=False).last_hidden_state


def answer_loss(model, ids, labels):
    """Next-token cross-entropy where labels are not -100 (`_batch`'s labels), with the LM head applied at those
    positions only: the same loss as over the full logits, without the head's work on prompts and padding (two
    thirds of the tokens)."""
    import torch

    hidden = target_hidden(model, ids)[:, :-1]
    targets = labels[:, 1:]
    scored = targets != -100
    return torch.nn.functional.cross_entropy(model.lm_head(hidden[scored]), targets[scored])


def optimize(params, batches: list, loss_of, *, lr: float, warmup_steps: int, tag: str, log=print) -> dict:
    """One AdamW step per batch (linear warm-up, cosine decay to a tenth, gradients clipped at 1): the main model's
    training and the MTP head's share it. `loss_of(batch)` returns the batch's loss tensor."""
    import math
    import time

    import torch

    steps = len(batches)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    schedule = lambda step: (
        min(1.0, (step + 1) / warmup_steps)
        * (  # noqa: E731
            0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, step / max(1, steps))))
        )
    )
    lr_at = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    losses = []
    start = time.monotonic()
    for step, batch in enumerate(batches):
        loss = loss_of(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        lr_at.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            log(f"[{tag}] step {step + 1}/{steps} loss {loss.item():.4f} ({time.monotonic() - start:.0f} s)")
    tail = losses[-min(20, len(losses)) :]
    return {
        "seconds": round(time.monotonic() - start, 1),
        "first_loss": round(losses[0], 4),
        "final_loss": round(sum(tail) / len(tail), 4),
    }


def train_model(
    model,
    tokenizer,
    *,
    conversations: list[dict],
    heldout: list[dict],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    threads: int,
    max_len: int = 512,
    warmup_steps: int = 20,
    device: str = "cpu",
    texts: list[dict] = (),
    text_max_len: int = 192,
) -> dict:
    """Supervised fine-tuning of the random model on `conversations` (loss on the answers only) and raw `texts`
    of a repeated sentence (encode_texts: loss on the repetitions), seeded and
    deterministic on CPU (fixed threads, deterministic kernels, fixed data order); returns what it measured.

    AdamW with linear warm-up and cosine decay; `heldout` conversations (not trained on) give a teacher-forced
    answer-token accuracy, a quick proxy for the gate's scores. `device` other than cpu is for experiments
    (learning curves on an accelerator): not deterministic, and not what the pipeline does."""
    import torch

    torch.set_num_threads(int(threads))
    torch.use_deterministic_algorithms(device == "cpu")
    torch.manual_seed(seed)
    train = encode_conversations(tokenizer, conversations, max_len) + encode_texts(tokenizer, texts, text_max_len, seed)
    held = encode_conversations(tokenizer, heldout, max_len)
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.float().to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_of(picked):
        return answer_loss(model, *(t.to(device) for t in _batch([train[i] for i in picked], pad_id)))

    plan = batch_order([len(p) + len(a) for p, a in train], batch_size, steps, seed)
    trained = optimize(
        params,
        plan,
        loss_of,
        lr=lr,
        warmup_steps=warmup_steps,
        tag="tiny train",
        log=lambda line: print(line, flush=True),
    )
    accuracy = answer_accuracy(model, held, pad_id, device)
    model.to("cpu").eval()
    return {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "threads": int(threads),
        "examples": len(train) - len(texts),
        "repeat_examples": len(texts),
        **trained,
        "heldout_answer_token_accuracy": round(accuracy, 4),
        "heldout_examples": len(held),
    }


def answer_accuracy(model, examples, pad_id: int, device: str = "cpu", batch_size: int = 32) -> float:
    """Teacher-forced greedy accuracy on answer tokens."""
    import torch

    right = total = 0
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            ids, labels = (t.to(device) for t in _batch(examples[i : i + batch_size], pad_id))
            guess = model(input_ids=ids, use_cache=False).logits[:, :-1].argmax(-1)
            mask = labels[:, 1:] != -100
            right += int(((guess == labels[:, 1:]) & mask).sum())
            total += int(mask.sum())
    return right / max(1, total)
