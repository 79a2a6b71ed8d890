"""Regenerate the tiny profile's lm-eval task data (deterministic; the output is committed).

    python3 data/tiny/tasks/generate.py

Small on purpose: a tiny CPU model answers a few dozen questions in minutes. The formats copy the real
tasks so the same harness code paths run: tiny_mc = MMLU-Pro's fields and prompt, tiny_mc_think =
GPQA's fields and prompt, tiny_ifeval = google/IFEval's fields scored by lm-eval's IFEval checks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
LETTERS = "ABCD"


def _arith(rng: random.Random, ops: str) -> tuple[str, int, str]:
    op = rng.choice(ops)
    a, b = rng.randint(11, 89), rng.randint(2, 39)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    word = {"+": "plus", "-": "minus", "*": "times"}[op]
    return f"What is {a} {word} {b}?", value, f"{a} {op} {b} = {value}"


def _options(rng: random.Random, value: int, gold: int) -> list[str]:
    wrong = set()
    while len(wrong) < 3:  # near misses, so letters, not magnitudes, carry the answer
        candidate = value + rng.choice([-1, 1]) * rng.randint(1, 12)
        if candidate != value:
            wrong.add(candidate)
    options = sorted(wrong)
    options.insert(gold, value)
    return [str(option) for option in options]


def mc_docs(seed: int, count: int, ops: str) -> list[dict]:
    rng = random.Random(seed)
    docs = []
    for i in range(count):
        question, value, work = _arith(rng, ops)
        gold = rng.randrange(4)
        docs.append({
            "question_id": i,
            "question": question,
            "options": _options(rng, value, gold),
            "answer": LETTERS[gold],
            "answer_index": gold,
            "cot_content": f"A: Let's think step by step. {work}. The answer is ({LETTERS[gold]}).",
            "category": "arithmetic",
            "src": "tiny",
        })
    return docs


def think_docs(seed: int, count: int) -> list[dict]:
    docs = []
    for doc in mc_docs(seed, count, "*+"):
        docs.append({"Question": " " + doc["question"], **{f"choice{i + 1}": o for i, o in enumerate(doc["options"])},
                     "choices": doc["options"], "answer": f"({doc['answer']})"})
    return docs


# (instruction_id, kwargs, sentence appended to the prompt); phrased as google/IFEval phrases them
INSTRUCTIONS = {
    "no_comma": ("punctuation:no_comma", {}, "Do not use any commas in your response."),
    "lower": ("change_case:english_lowercase", {},
              "Your entire response should be in English, and in all lowercase letters. No capital letters are allowed."),
    "upper": ("change_case:english_capital", {}, "Your entire response should be in English and in all capital letters."),
    "bullets": ("detectable_format:number_bullet_lists", {"num_bullets": 3},
                "Your answer must contain exactly 3 bullet points. Use the markdown bullet points such as:\n* This is point 1."),
    "title": ("detectable_format:title", {},
              "Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>."),
    "keywords": ("keywords:existence", {"keywords": ["river", "stone"]}, "Include the keywords river and stone in the response."),
    "forbidden": ("keywords:forbidden_words", {"forbidden_words": ["very", "really"]},
                  "Do not include the words very or really in the response."),
    "end": ("startend:end_checker", {"end_phrase": "Is there anything else I can help with?"},
            "Finish your response with this exact phrase Is there anything else I can help with?. "
            "No other words should follow this phrase."),
    "quote": ("startend:quotation", {}, "Wrap your entire response with double quotation marks."),
    "ps": ("detectable_content:postscript", {"postscript_marker": "P.S."},
           "At the end of your response, please explicitly add a postscript starting with P.S."),
    "short": ("length_constraints:number_words", {"num_words": 40, "relation": "less than"}, "Answer with less than 40 words."),
    "json": ("detectable_format:json_format", {}, "Entire output should be wrapped in JSON format."),
    "highlight": ("detectable_format:number_highlighted_sections", {"num_highlights": 2},
                  "Highlight at least 2 sections in your answer with markdown, i.e. *highlighted section*."),
    "letter": ("keywords:letter_frequency", {"letter": "z", "let_frequency": 2, "let_relation": "at least"},
               "In your response, the letter z should appear at least 2 times."),
    "paragraphs": ("length_constraints:number_paragraphs", {"num_paragraphs": 2},
                   "There should be 2 paragraphs. Paragraphs are separated with the markdown divider: ***"),
    "frequency": ("keywords:frequency", {"keyword": "light", "frequency": 2, "relation": "at least"},
                  "In your response, the word light should appear at least 2 times."),
    "placeholders": ("detectable_content:number_placeholders", {"num_placeholders": 2},
                     "The response must contain at least 2 placeholders represented by square brackets, such as [address]."),
}

IFEVAL_PROMPTS = [  # (request, instructions); none needs nltk's punkt data (absent on offline hosts)
    ("Write a short note to a neighbour about a lost cat.", ["no_comma"]),
    ("Describe a walk along a river at dawn.", ["lower"]),
    ("Give advice to someone starting to learn the violin.", ["upper"]),
    ("List reasons to keep a garden.", ["bullets"]),
    ("Write a four-line poem about rain.", ["title"]),
    ("Tell a tiny story about a child who finds a map.", ["keywords"]),
    ("Explain why the sky looks blue.", ["forbidden"]),
    ("Reply to a customer asking when their parcel arrives.", ["end"]),
    ("Say something kind about libraries.", ["quote"]),
    ("Write a thank-you message to a teacher.", ["ps"]),
    ("Summarise what a volcano is.", ["short"]),
    ("Describe a bicycle: its colour, size and owner.", ["json"]),
    ("Write a product description for a lamp.", ["highlight"]),
    ("Write a sentence about a lazy zebra at the zoo.", ["letter"]),
    ("Describe winter in a mountain village.", ["paragraphs"]),
    ("Describe a lighthouse at night.", ["frequency"]),
    ("Draft a letter inviting a friend to dinner.", ["placeholders"]),
    ("Write a haiku about autumn leaves.", ["lower", "no_comma"]),
    ("Explain how to boil an egg.", ["bullets", "end"]),
    ("Describe your favourite season.", ["title", "ps"]),
    ("Write a motto for a rowing club.", ["upper", "short"]),
    ("Describe a quiet beach.", ["keywords", "forbidden"]),
    ("Write a review of a bakery.", ["highlight", "no_comma"]),
    ("Tell a riddle about the moon.", ["quote", "short"]),
]


def ifeval_docs() -> list[dict]:
    keys = sorted({k for _, kwargs, _ in INSTRUCTIONS.values() for k in kwargs})
    docs = []
    for key, (request, names) in enumerate(IFEVAL_PROMPTS, start=1000):
        picked = [INSTRUCTIONS[name] for name in names]
        docs.append({
            "key": key,
            "prompt": " ".join([request, *(text for _, _, text in picked)]),
            "instruction_id_list": [iid for iid, _, _ in picked],
            # google/IFEval stores every kwargs key in every dict, unused ones null
            "kwargs": [{k: kwargs.get(k) for k in keys} for _, kwargs, _ in picked],
        })
    return docs


def write_jsonl(name: str, docs: list[dict]) -> None:
    (HERE / name).write_text("".join(json.dumps(doc, sort_keys=True) + "\n" for doc in docs))


if __name__ == "__main__":
    write_jsonl("tiny_mc.test.jsonl", mc_docs(seed=1, count=32, ops="+-"))
    write_jsonl("tiny_mc.validation.jsonl", mc_docs(seed=2, count=5, ops="+-"))
    write_jsonl("tiny_mc_think.test.jsonl", think_docs(seed=3, count=24))
    write_jsonl("tiny_ifeval.test.jsonl", ifeval_docs())
