"""Learning-curve experiment for the tiny profile's training (issue #5): trains the tiny model with the
pipeline's own code (lib.tiny.training.training_plan, lib.tiny.synthesis.build_tiny_checkpoint)
and reports the training record
and greedy transformers answers on the committed tiny_mc / tiny_mc_think test splits (a quick proxy for the
gate, which scores through vLLM and lm-eval). `--device cuda` runs it on a GPU (not deterministic).

    .venvs/compress/bin/python gpu_proof/experiments/train_curves.py . /tmp/out --steps 300 --lr 0.002 --eval 1

`--cot 1` trains written-out reasoning before the letter (tried; did not help with shuffled options).
gpu_proof/experiments/grid.sh ran the H100 grids quoted in config/tiny.yaml.
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(sys.argv[1]).resolve()
sys.path.insert(0, str(ROOT / "scripts"))
from lib.tiny.synthesis import build_tiny_checkpoint
from lib.tiny.tokenizer import train_tokenizer
from lib.tiny.training import load_generator, training_plan

ap = argparse.ArgumentParser()
ap.add_argument("root")
ap.add_argument("out")
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--lr", type=float, default=0.004)
ap.add_argument("--examples", type=int, default=3000)
ap.add_argument("--device", default="cpu")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--dims", default="{}")
ap.add_argument("--warmup", type=int, default=10)
ap.add_argument("--eval", type=int, default=0)
ap.add_argument("--cot", type=int, default=0)
ap.add_argument("--seed", type=int, default=0)
a = ap.parse_args()
gen = load_generator(ROOT / "data/tiny/tasks/generate.py")
train = {
    "steps": a.steps,
    "lr": a.lr,
    "warmup_steps": a.warmup,
    "batch_size": a.batch,
    "seed": a.seed,
    "data_seed": 1000 + a.seed,
    "examples": a.examples,
    "heldout_examples": 60,
    "threads": a.threads,
}
plan = training_plan(train, gen)
plan["device"] = a.device
import re as _re

# per task: how its prompt lists the options, and the reasoned answer to train instead
COT = {
    "tiny_mc": (r"^([ABCD])\. (.*)$", "{word} is {q}. The answer is ({letter})."),
    "tiny_mc_think": (r"^\(([ABCD])\) (.*)$", "I look for {q}. {word} is {q}.\n</think>\n\nThe answer is ({letter})."),
}


def _cot(conv):
    if conv["task"] not in COT:
        return conv
    option_pattern, template = COT[conv["task"]]
    text = conv["messages"][-1]["content"]
    options = dict(_re.findall(option_pattern, text, _re.M))
    letter = _re.search(r"\(([ABCD])\)\.$", conv["answer"]).group(1)
    q = _re.search(r"is (an? \w+)\?", text).group(1)
    return dict(conv, answer=template.format(word=options[letter].capitalize(), q=q, letter=letter))


if a.cot:
    plan["conversations"] = [_cot(c) for c in plan["conversations"]]
    plan["heldout"] = [_cot(c) for c in plan["heldout"]]
    print("EXAMPLE", [c["answer"] for c in plan["conversations"][:3]], flush=True)
out = Path(a.out)
out.mkdir(parents=True, exist_ok=True)
train_tokenizer(ROOT / "data/tiny/corpus.txt", 4096, out, extra_text=gen.tokenizer_text())
t0 = time.time()
res = build_tiny_checkpoint(out, 0, out, train=plan, **json.loads(a.dims))
print("TRAIN", json.dumps(res["training"]), "wall", round(time.time() - t0, 1), flush=True)
if a.eval:
    import re

    import torch
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(str(out))
    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(out), dtype=torch.bfloat16).eval()
    tests = gen.test_docs()

    def gen_text(messages, thinking, n=32):
        p = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        ids = tok(p, return_tensors="pt", add_special_tokens=False).input_ids
        o = model.generate(ids, max_new_tokens=n, do_sample=False)
        return tok.decode(o[0, ids.shape[1] :], skip_special_tokens=True)

    right = 0
    for d in tests["tiny_mc"]:
        t = gen_text(
            [{"role": "system", "content": gen.MC_DESCRIPTION}, {"role": "user", "content": gen.mmlu_pro_text(d)}],
            False,
        )
        m = re.search(r"answer is \(?([ABCD])\)?", t)
        right += bool(m and m.group(1) == d["answer"])
    print("MC", right, len(tests["tiny_mc"]), repr(t), flush=True)
    right = 0
    for d in tests["tiny_mc_think"]:
        t = gen_text([{"role": "user", "content": gen.GPQA_TEMPLATE.format(**d)}], True, 48)
        m = re.search(r"answer is \(?([ABCD])\)?", t)
        right += bool(m and f"({m.group(1)})" == d["answer"])
    print("THINK", right, len(tests["tiny_mc_think"]), repr(t), flush=True)
    for d in tests["tiny_ifeval"][:4]:
        print("IFEVAL", repr(gen_text([{"role": "user", "content": d["prompt"]}], False, 64)))
