"""Regenerate the tiny profile's lm-eval task data (deterministic; the output is committed).

    python3 scripts/lib/tiny/tasks.py

Small on purpose: a tiny CPU model answers a few dozen questions in minutes. The formats copy the real
tasks so the same harness code paths run: tiny_mc = MMLU-Pro's fields and prompt, tiny_mc_think =
GPQA's fields and prompt, tiny_ifeval = google/IFEval's fields scored by lm-eval's IFEval checks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# The tiny lm-eval tasks (their YAML, utils.py and the splits this writes): quality.tasks_dir in config/tiny.yaml.
TASKS_DIR = Path(__file__).resolve().parents[3] / "data" / "tiny" / "tasks"
LETTERS = "ABCD"
# Category questions: one option of each category, always in the same category order, so the asked category
# decides the letter. Measured on an H100 (issue #5): with the options shuffled, the 4-layer model stayed at
# chance (always one letter) after 1,500 steps, with or without a written-out reasoning step; finding the
# letter of a shuffled option is a look-up it does not learn in CPU minutes. The question -> letter mapping it
# does learn, and a broken checkpoint loses it, which is what the tiny gate has to tell apart.
CATEGORIES = {
    "fruit": ["apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "pear", "plum"],
    "colour": ["red", "blue", "green", "yellow", "brown", "purple", "pink", "grey", "black"],
    "animal": ["dog", "cat", "horse", "sheep", "mouse", "tiger", "bear", "goat", "duck"],
    "tool": ["hammer", "saw", "drill", "wrench", "shovel", "chisel", "rake", "ladder", "spanner"],
}
CATEGORY_ORDER = sorted(CATEGORIES)  # option A is an animal, B a colour, C a fruit, D a tool
ARTICLE = {"fruit": "a", "colour": "a", "animal": "an", "tool": "a"}


def _question(rng: random.Random, gold: int) -> tuple[str, list[str], str]:
    """(question, options in category order, asked category) for the category at letter index `gold`."""
    category = CATEGORY_ORDER[gold]
    options = [rng.choice(CATEGORIES[c]) for c in CATEGORY_ORDER]
    return f"Which of the following is {ARTICLE[category]} {category}?", options, category


def mc_docs(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    # a split's letters come equally often, so answering one letter always scores 0.25, not more
    golds = [i % 4 for i in range(count)] if count >= 4 else [rng.randrange(4) for _ in range(count)]
    rng.shuffle(golds)
    docs = []
    for i, gold in enumerate(golds):
        question, options, category = _question(rng, gold)
        word = options[gold]
        docs.append(
            {
                "question_id": i,
                "question": question,
                "options": options,
                "answer": LETTERS[gold],
                "answer_index": gold,
                "cot_content": f"A: Let's think step by step. {word.capitalize()} is {ARTICLE[category]} {category}. "
                f"The answer is ({LETTERS[gold]}).",
                "category": "categories",
                "src": "tiny",
            }
        )
    return docs


def think_docs(seed: int, count: int) -> list[dict]:
    docs = []
    for doc in mc_docs(seed, count):
        docs.append(
            {
                "Question": " " + doc["question"],
                **{f"choice{i + 1}": o for i, o in enumerate(doc["options"])},
                "choices": doc["options"],
                "answer": f"({doc['answer']})",
            }
        )
    return docs


# (instruction_id, kwargs, sentence appended to the prompt); phrased as google/IFEval phrases them
INSTRUCTIONS = {
    "no_comma": ("punctuation:no_comma", {}, "Do not use any commas in your response."),
    "lower": (
        "change_case:english_lowercase",
        {},
        "Your entire response should be in English, and in all lowercase letters. No capital letters are allowed.",
    ),
    "upper": (
        "change_case:english_capital",
        {},
        "Your entire response should be in English and in all capital letters.",
    ),
    "bullets": (
        "detectable_format:number_bullet_lists",
        {"num_bullets": 3},
        "Your answer must contain exactly 3 bullet points. Use the markdown bullet points such as:\n* This is point 1.",
    ),
    "title": (
        "detectable_format:title",
        {},
        "Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>.",
    ),
    "keywords": (
        "keywords:existence",
        {"keywords": ["river", "stone"]},
        "Include the keywords river and stone in the response.",
    ),
    "forbidden": (
        "keywords:forbidden_words",
        {"forbidden_words": ["very", "really"]},
        "Do not include the words very or really in the response.",
    ),
    "end": (
        "startend:end_checker",
        {"end_phrase": "Is there anything else I can help with?"},
        "Finish your response with this exact phrase Is there anything else I can help with?. "
        "No other words should follow this phrase.",
    ),
    "quote": ("startend:quotation", {}, "Wrap your entire response with double quotation marks."),
    "ps": (
        "detectable_content:postscript",
        {"postscript_marker": "P.S."},
        "At the end of your response, please explicitly add a postscript starting with P.S.",
    ),
    "short": (
        "length_constraints:number_words",
        {"num_words": 40, "relation": "less than"},
        "Answer with less than 40 words.",
    ),
    "json": ("detectable_format:json_format", {}, "Entire output should be wrapped in JSON format."),
    "highlight": (
        "detectable_format:number_highlighted_sections",
        {"num_highlights": 2},
        "Highlight at least 2 sections in your answer with markdown, i.e. *highlighted section*.",
    ),
    "letter": (
        "keywords:letter_frequency",
        {"letter": "z", "let_frequency": 2, "let_relation": "at least"},
        "In your response, the letter z should appear at least 2 times.",
    ),
    "paragraphs": (
        "length_constraints:number_paragraphs",
        {"num_paragraphs": 2},
        "There should be 2 paragraphs. Paragraphs are separated with the markdown divider: ***",
    ),
    "frequency": (
        "keywords:frequency",
        {"keyword": "light", "frequency": 2, "relation": "at least"},
        "In your response, the word light should appear at least 2 times.",
    ),
    "placeholders": (
        "detectable_content:number_placeholders",
        {"num_placeholders": 2},
        "The response must contain at least 2 placeholders represented by square brackets, such as [address].",
    ),
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
        docs.append(
            {
                "key": key,
                "prompt": " ".join([request, *(text for _, _, text in picked)]),
                "instruction_id_list": [iid for iid, _, _ in picked],
                # google/IFEval stores every kwargs key in every dict, unused ones null
                "kwargs": [{k: kwargs.get(k) for k in keys} for _, kwargs, _ in picked],
            }
        )
    return docs


# ---- training conversations for the tiny model (scripts/tiny_model.py trains on these) -----------------
# The prompts are the ones lm-eval sends through local-chat-completions (tests compare them with lm-eval's
# own rendering); the answers are what a model that follows them would write, short enough for max_tokens.

MC_DESCRIPTION = (
    "The following are multiple choice questions (with answers) about categories. Think step by step "
    'and then finish your answer with "the answer is (X)" where X is the correct letter choice.\n'
)
GPQA_TEMPLATE = (
    "What is the correct answer to this question:{Question}\nChoices:\n(A) {choice1}\n(B) {choice2}\n"
    "(C) {choice3}\n(D) {choice4}\nLet's think step by step: "
)


def mmlu_pro_text(doc: dict) -> str:
    """lm-eval's mmlu_pro doc_to_text (format_cot_example without the answer)."""
    options = "".join(f"{LETTERS[i]}. {option}\n" for i, option in enumerate(doc["options"]))
    return f"Question:\n{doc['question']}\nOptions:\n{options}Answer: Let's think step by step."


IFEVAL_TOPICS = [
    "a red kite",
    "the old mill",
    "a market town",
    "a sleepy dog",
    "the night train",
    "a school play",
    "a winter coat",
    "the harbour",
    "a bowl of soup",
    "an empty road",
    "a tall clock",
    "the first snow",
    "a paper boat",
    "a busy kitchen",
    "the garden gate",
    "a broken chair",
    "a map of the city",
    "a summer fair",
    "the quiet library",
    "a wooden bridge",
]
IFEVAL_REQUESTS = [
    "Write a few lines about {}.",
    "Tell me something about {}.",
    "Describe {} briefly.",
    "Write a short message about {}.",
    "Give a small description of {}.",
]
# Pairs a single answer cannot satisfy together; never asked together (the test prompts avoid them too).
IFEVAL_CLASHES = {
    frozenset(p)
    for p in [
        ("lower", "upper"),
        ("lower", "end"),
        ("lower", "title"),
        ("lower", "ps"),
        ("lower", "json"),
        ("lower", "placeholders"),
        ("upper", "keywords"),
        ("upper", "frequency"),
        ("upper", "letter"),
        ("upper", "forbidden"),
        ("json", "bullets"),
        ("json", "title"),
        ("json", "quote"),
        ("json", "end"),
        ("json", "ps"),
        ("json", "paragraphs"),
        ("json", "highlight"),
        ("bullets", "highlight"),
        # capitals are one token a letter in the tiny tokenizer: kept short, within the tasks' max_tokens
        ("upper", "end"),
        ("upper", "bullets"),
        ("upper", "paragraphs"),
        ("upper", "ps"),
        ("upper", "title"),
        ("upper", "placeholders"),
        ("upper", "highlight"),
        ("bullets", "paragraphs"),
        ("quote", "end"),
        ("quote", "ps"),
        ("quote", "title"),
        ("quote", "bullets"),
        ("quote", "paragraphs"),
        ("keywords", "frequency"),
        ("keywords", "letter"),
        ("frequency", "letter"),
        ("json", "no_comma"),
    ]
}


def ifeval_answer(names: list[str]) -> str:
    """An answer that follows every named instruction (each one changes it in its own way)."""
    body = "this is my short answer and it is written in plain english for you"
    if "keywords" in names:
        body = "the river runs past the stone and it is written in plain english for you"
    if "frequency" in names:
        body = "the light of the moon and the light of the sun are written here for you"
    if "letter" in names:
        body = "a lazy zebra dozes in the sun and it is written in plain english for you"
    if "placeholders" in names:
        body += " at [place] with [name]"
    if "highlight" in names:
        body = f"*{body}* and *one more part*"
    if "bullets" in names:
        body = f"* {body}\n* one more point\n* a last point"
    if "paragraphs" in names:
        body = f"{body}\n***\none more part of the answer"
    if "title" in names:
        body = f"<<a short answer>>\n{body}"
    if "ps" in names:
        body = f"{body}\nP.S. thank you for reading"
    if "end" in names:
        body = f"{body} Is there anything else I can help with?"
    if "upper" in names:
        body = "YES I WILL HELP YOU WITH THIS"  # langdetect must still call it English
    if "json" in names:
        body = json.dumps({"answer": body})
    if "quote" in names:
        body = f'"{body}"'
    return body


def _item(doc: dict) -> str:
    """What makes a question the same question (ids aside): its text and its options in order."""
    return json.dumps(
        [
            doc.get("question", doc.get("Question", "")).strip(),
            doc.get("options", doc.get("choices")),
            doc.get("prompt"),
        ]
    )


TRAIN_TASKS = ("tiny_mc", "tiny_mc_think", "tiny_ifeval")


def train_conversations(
    seed: int,
    count: int,
    test_docs: dict[str, list[dict]],
    exclude: list[dict] = (),
    cycle: tuple[str, ...] = TRAIN_TASKS,
) -> list[dict]:
    """`count` training conversations, their tasks taking turns as `cycle` lists them (a task listed twice gets
    twice the examples), none equal to a test doc or to one in `exclude`: {task, messages (as lm-eval sends them),
    thinking (enable_thinking), answer (the assistant's text after the chat template's generation prompt, reasoning
    included when thinking is on)}."""
    unknown = sorted(set(cycle) - set(TRAIN_TASKS))
    if unknown or not cycle:
        raise ValueError(f"tasks {unknown or 'none'} in the cycle: the generator trains {', '.join(TRAIN_TASKS)}")
    rng = random.Random(seed)
    seen = {_item(doc) for docs in test_docs.values() for doc in docs}
    test_prompts = {doc["prompt"] for doc in test_docs.get("tiny_ifeval", [])}
    excluded = {json.dumps(conv["messages"]) for conv in exclude}
    out = []
    while len(out) < count:
        kind = cycle[len(out) % len(cycle)]
        if kind == "tiny_mc":
            doc = mc_docs(rng.randrange(2**31), 1)[0]
            if _item(doc) in seen:
                continue
            messages = [{"role": "system", "content": MC_DESCRIPTION}, {"role": "user", "content": mmlu_pro_text(doc)}]
            answer = f"The answer is ({doc['answer']})."  # one letter to learn: no reasoning to copy it from
            conv = {"task": kind, "messages": messages, "thinking": False, "answer": answer}
        elif kind == "tiny_mc_think":
            doc = think_docs(rng.randrange(2**31), 1)[0]
            if _item(doc) in seen:
                continue
            messages = [{"role": "user", "content": GPQA_TEMPLATE.format(**doc)}]
            asked = doc["Question"].strip().removeprefix("Which of the following is ").rstrip("?")
            answer = f"I look for {asked}.\n</think>\n\nThe answer is {doc['answer']}."
            conv = {"task": kind, "messages": messages, "thinking": True, "answer": answer}
        else:
            names = rng.sample(sorted(INSTRUCTIONS), rng.choice([1, 1, 2]))
            if frozenset(names) in IFEVAL_CLASHES:
                continue
            request = rng.choice(IFEVAL_REQUESTS).format(rng.choice(IFEVAL_TOPICS))
            prompt = " ".join([request, *(INSTRUCTIONS[name][2] for name in names)])
            if prompt in test_prompts:
                continue
            conv = {
                "task": kind,
                "messages": [{"role": "user", "content": prompt}],
                "thinking": False,
                "answer": ifeval_answer(names),
            }
        if json.dumps(conv["messages"]) not in excluded:
            out.append(conv)
    return out


# ---- repeated text (raw, no chat template): the latency probe's prompts are one sentence repeated -------------
# A model that continues the repetition lets a prompt-copying drafter (and the MTP layer) be measured for real.
REPEAT_WORDS = sorted(
    {w for words in CATEGORIES.values() for w in words}
    | {w for topic in IFEVAL_TOPICS for w in topic.split()[1:]}
    | set(
        "the a old new small big quiet busy slow fast green warm cold bright dark little "
        "walks runs sees finds keeps sings waits jumps sleeps reads paints carries opens "
        "near over under behind beside along across into from with by at "
        "hill river road house window garden forest field morning evening boat city".split()
    )
)


def repeat_sentence(rng: random.Random) -> str:
    """A made-up sentence (4-14 random words), so copying it is learnt from the context, not remembered."""
    words = [rng.choice(REPEAT_WORDS) for _ in range(rng.randint(4, 14))]
    return " ".join(words).capitalize() + ". "


def repeated_texts(
    seed: int, count: int, sentences: list[str] = (), share: float = 0.25, repeats: int = 40
) -> list[dict]:
    """`count` raw texts of one sentence repeated `repeats` times (the trainer cuts them to its length): a `share`
    of them repeat one of `sentences` (the latency probe's), the rest a made-up sentence. {task, sentence, text}."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        own = sentences and int((i + 1) * share) > int(i * share)
        sentence = sentences[i % len(sentences)] if own else repeat_sentence(rng)
        out.append({"task": "repeat", "sentence": sentence, "text": sentence * repeats})
    return out


def tokenizer_text(repeats: int = 8) -> str:
    """The tasks' fixed wording (instructions, prompt scaffolding, the trained answers' words), repeated so
    byte-level BPE merges it: added to the tiny tokenizer's corpus when the model is trained."""
    fixed = [
        MC_DESCRIPTION,
        mmlu_pro_text({"question": "Which of the following is a fruit?", "options": list("1234")}),
        GPQA_TEMPLATE.format(
            Question=" Which of the following is an animal?", choice1=1, choice2=2, choice3=3, choice4=4
        ),
        "The answer is (A). The answer is (B). The answer is (C). The answer is (D). I look for a tool.",
        *(" ".join(words) for words in CATEGORIES.values()),
        *(text for _, _, text in INSTRUCTIONS.values()),
        *IFEVAL_REQUESTS,
        *IFEVAL_TOPICS,
        *(ifeval_answer([name]) for name in INSTRUCTIONS),
    ]
    return "\n".join(line for _ in range(repeats) for text in fixed for line in text.splitlines() if line.strip())


def test_docs() -> dict[str, list[dict]]:
    """The committed test splits (what train_conversations keeps out of training)."""
    return {
        stem: [json.loads(line) for line in (TASKS_DIR / f"{stem}.test.jsonl").read_text().splitlines() if line]
        for stem in ("tiny_mc", "tiny_mc_think", "tiny_ifeval")
    }


def write_jsonl(name: str, docs: list[dict]) -> None:
    (TASKS_DIR / name).write_text("".join(json.dumps(doc, sort_keys=True) + "\n" for doc in docs))


if __name__ == "__main__":
    write_jsonl("tiny_mc.test.jsonl", mc_docs(seed=1, count=32))
    write_jsonl("tiny_mc.validation.jsonl", mc_docs(seed=2, count=5))
    write_jsonl("tiny_mc_think.test.jsonl", think_docs(seed=3, count=24))
    write_jsonl("tiny_ifeval.test.jsonl", ifeval_docs())
