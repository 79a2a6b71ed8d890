"""Vocabulary pruning of a byte-level BPE checkpoint (stdlib only: the planning and the tokenizer rewrite; the
quantize stage slices the tensors with what this returns).

A decode step reads the whole LM head, so fewer ids mean fewer bytes per token (Qwen3.5-4B: 248,320 x 2560; the
2nd-place entry kept ~131k ids and passed GPQA, 96k failed it). What is kept, in order, until `size` ids:
every added/special token, the 256 byte symbols (so any text still encodes), every id the required texts use, then
the lowest ids (BPE ids follow merge order: earliest merges are the most frequent pieces). Every kept token brings
the tokens its merge is made of, so the kept merges reproduce the original segmentation of any text whose original
tokens all survive: each merge applied on such a text builds a piece of a kept token, so it is kept too, and
dropping merges never applicable there changes nothing. New ids keep the old order.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

from lib.safetensors import checkpoint_header

MULTIPLE = 64  # vLLM pads/tiles the vocabulary dim by 64 (Marlin's out_features tile for a quantized head)


class PruneError(ValueError):
    """A pruning size or tokenizer this module cannot honour; the message names what and why."""


def byte_symbols() -> list[str]:
    """The 256 symbols byte-level BPE writes bytes as (GPT-2's bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def _merges(model: dict) -> list[tuple[str, str]]:
    # tokenizers writes merges as ["a", "b"] pairs (new format) or "a b" strings (old)
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]


def _check_supported(tokenizer: dict) -> None:
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE":
        raise PruneError(f"only BPE tokenizers can be pruned, this one is {model.get('type')!r}")
    if (tokenizer.get("decoder") or {}).get("type") != "ByteLevel":
        raise PruneError("only byte-level BPE (its decoder ByteLevel) can be pruned: other texts may not encode")


def plan_kept_ids(tokenizer: dict, size: int, required_ids: set[int], vocab_rows: int) -> list[int]:
    """Old ids to keep (ascending), exactly `size` of them. `vocab_rows` is the checkpoint's vocab_size (its
    embedding rows may exceed the tokenizer's ids: padding rows, never kept)."""
    _check_supported(tokenizer)
    model = tokenizer["model"]
    vocab: dict[str, int] = model["vocab"]
    added = {t["id"] for t in tokenizer.get("added_tokens", [])}
    if size % MULTIPLE or size <= 0:
        raise PruneError(f"size {size} must be a positive multiple of {MULTIPLE} (the GPU kernels tile the head by it)")
    ids = set(vocab.values())
    total = len(ids | added)
    if size > total:
        raise PruneError(f"size {size} is larger than the tokenizer's {total} ids: nothing to prune")
    if size >= vocab_rows:
        raise PruneError(f"size {size} does not shrink the checkpoint's {vocab_rows} vocabulary rows")
    unknown = sorted(i for i in required_ids if i not in added and i not in ids)
    if unknown:
        raise PruneError(f"required ids {unknown[:8]} are not in the tokenizer")
    token_of = {i: t for t, i in vocab.items()}
    parents = {a + b: (a, b) for a, b in _merges(model)}

    def with_ancestors(token_id: int) -> set[int]:
        found, stack = set(), [token_id]
        while stack:
            current = stack.pop()
            if current in found:
                continue
            found.add(current)
            pair = parents.get(token_of.get(current, ""))
            if pair:
                stack.extend(vocab[p] for p in pair if p in vocab)
        return found

    missing_bytes = [s for s in byte_symbols() if s not in vocab]
    if missing_bytes:
        raise PruneError(
            f"the tokenizer lacks {len(missing_bytes)} of the 256 byte symbols: pruned text could not encode"
        )
    keep = set(added) | {vocab[s] for s in byte_symbols()}
    for token_id in sorted(required_ids - added):
        keep |= with_ancestors(token_id)
    if len(keep) > size:
        raise PruneError(
            f"size {size} is smaller than the {len(keep)} ids that must survive (added/special tokens, the 256 byte "
            f"symbols, every id of the required texts and the pieces they merge from)"
        )
    for token_id in sorted(token_of):
        if len(keep) == size:
            break
        if token_id not in keep:
            grown = keep | with_ancestors(token_id)
            if len(grown) <= size:
                keep = grown
    if len(keep) != size:  # only when every remaining token needs more ancestors than fit: never on a real BPE
        raise PruneError(f"could not fill {size} ids with whole merge chains (stopped at {len(keep)})")
    return sorted(keep)


def pruned_tokenizer(tokenizer: dict, kept: list[int]) -> dict:
    """tokenizer.json with only the kept ids, renumbered in their old order, and only merges whose pieces and
    result are all kept."""
    new_id = {old: new for new, old in enumerate(kept)}
    out = copy.deepcopy(tokenizer)
    model = out["model"]
    model["vocab"] = {
        t: new_id[i] for t, i in sorted(tokenizer["model"]["vocab"].items(), key=lambda x: x[1]) if i in new_id
    }
    kept_tokens = set(model["vocab"])
    as_lists = bool(model["merges"]) and isinstance(model["merges"][0], list)
    merges = [(a, b) for a, b in _merges(tokenizer["model"]) if {a, b, a + b} <= kept_tokens]
    model["merges"] = [list(m) if as_lists else " ".join(m) for m in merges]
    out["added_tokens"] = [dict(t, id=new_id[t["id"]]) for t in tokenizer.get("added_tokens", [])]
    post = out.get("post_processor") or {}
    for special in (post.get("special_tokens") or {}).values():
        special["ids"] = [new_id[i] for i in special.get("ids", [])]
    return out


_ID_KEY = re.compile(r"(^|_)token_ids?$")


def remap_token_ids(data: dict, new_id: dict[int, int], where: str) -> dict:
    """Every *_token_id / *_token_ids value (int or list, top level and text_config) renumbered; a value whose
    token was dropped is an error naming the key."""
    out = copy.deepcopy(data)

    def remap(section: dict, prefix: str) -> None:
        for key, value in section.items():
            if not _ID_KEY.search(key) or value is None:
                continue
            values = value if isinstance(value, list) else [value]
            lost = [v for v in values if v not in new_id]
            if lost:
                raise PruneError(f"{where}: {prefix}{key} names ids {lost} that pruning drops")
            mapped = [new_id[v] for v in values]
            section[key] = mapped if isinstance(value, list) else mapped[0]

    remap(out, "")
    if isinstance(out.get("text_config"), dict):
        remap(out["text_config"], "text_config.")
    return out


def remap_added_tokens_decoder(tokenizer_config: dict, new_id: dict[int, int]) -> dict:
    """tokenizer_config.json's added_tokens_decoder is keyed by id (as a string)."""
    out = copy.deepcopy(tokenizer_config)
    if "added_tokens_decoder" in out:
        out["added_tokens_decoder"] = {str(new_id[int(k)]): v for k, v in out["added_tokens_decoder"].items()}
    return out


def vocab_sized_tensors(header: dict[str, dict], vocab_rows: int) -> list[str]:
    """Tensors with one row per id: the embedding, an untied head, any MTP embedding (dim 0 == vocab rows)."""
    return sorted(
        name
        for name, info in header.items()
        if len(info["shape"]) == 2 and info["shape"][0] == vocab_rows and ("embed" in name or "lm_head" in name)
    )


def _strings(value):
    """Every string inside a JSON value."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def required_texts(paths: list[str], sentence: str | None) -> list[str]:
    """Texts whose tokens must survive: plain files whole, JSON-lines files as every string value of every
    record (lm-eval task data: questions, choices, answers), and the probe's sentence repeated."""
    texts = []
    for path in paths:
        body = Path(path).read_text(encoding="utf-8")
        if not path.endswith(".jsonl"):
            texts.append(body)
            continue
        texts.extend(s for line in body.splitlines() if line.strip() for s in _strings(json.loads(line)))
    if sentence:
        texts.append(sentence * 4)
    return texts


def write_pruned_checkpoint(model_dir, out_dir, kept: list[int]) -> dict:
    """The checkpoint with only the kept ids: every one-row-per-id tensor sliced (embedding, untied head, MTP
    embedding), config.json's vocab_size and token ids, generation_config.json's ids, tokenizer.json and
    tokenizer_config.json renumbered; every other file copied. Returns what was done."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config") or config
    rows = text["vocab_size"]
    new_id = {old: new for new, old in enumerate(kept)}
    index = torch.tensor(kept, dtype=torch.long)
    sliced = []
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as handle:
            metadata = handle.metadata()
            names = list(handle.keys())
            header = {n: {"shape": list(handle.get_slice(n).get_shape())} for n in names}
            by_row = set(vocab_sized_tensors(header, rows))
            tensors = {}
            for name in names:
                tensor = handle.get_tensor(name)
                if name in by_row:
                    tensor = tensor.index_select(0, index).contiguous()
                    sliced.append(name)
                tensors[name] = tensor
        save_file(tensors, str(out_dir / shard.name), metadata=metadata)
    if not sliced:
        raise PruneError(f"no tensor of {model_dir} has one row per id ({rows} rows): nothing to slice")
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and not path.name.startswith(".") and not (out_dir / path.name).exists():
            shutil.copy2(path, out_dir / path.name)

    def rewrite(name: str, change) -> None:
        if (model_dir / name).is_file():
            data = json.loads((model_dir / name).read_text())
            (out_dir / name).write_text(json.dumps(change(data), indent=2, ensure_ascii=False, sort_keys=True) + "\n")

    def resize(data: dict) -> dict:
        data = remap_token_ids(data, new_id, "config.json")
        (data.get("text_config") or data)["vocab_size"] = len(kept)
        return data

    rewrite("config.json", resize)
    rewrite("generation_config.json", lambda d: remap_token_ids(d, new_id, "generation_config.json"))
    rewrite("tokenizer.json", lambda d: pruned_tokenizer(d, kept))
    rewrite("tokenizer_config.json", lambda d: remap_added_tokens_decoder(d, new_id))
    index_file = out_dir / "model.safetensors.index.json"
    if index_file.is_file():
        data = json.loads(index_file.read_text())
        data["metadata"]["total_size"] = sum(info["bytes"] for info in checkpoint_header(out_dir).values())
        index_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return {"rows_before": rows, "rows": len(kept), "sliced_tensors": sorted(sliced)}


def pruned_header(header: dict[str, dict], rows: int, size: int) -> dict[str, dict]:
    """The safetensors header once pruned to `size` ids (what the guards plan the recipe against)."""
    sliced = set(vocab_sized_tensors(header, rows))
    return {
        name: (
            dict(info, shape=[size, *info["shape"][1:]], bytes=info["bytes"] // rows * size) if name in sliced else info
        )
        for name, info in header.items()
    }
