"""Train chatkit's LoRA adapter for SmolLM2-135M-Instruct: the demo's ``calculate`` tool, recall of what the
user said, and "I don't know" when the user did not say it.

SmolLM2's chat template renders neither tools nor tool calls, and mlx-lm finds no tool format in it, so
chatkit loads the model for this adapter with ``tool_parser_type="json_tools"`` (mlx-lm's Qwen/Hermes
parser): a reply's ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` is then a call, past
calls are written back in that form, and tool results go in as user messages
``{"tool_response": {...}}`` (chatkit's rendering for templates without a tool role). The training text
is exactly what chatkit renders: every dialogue is a list of ``ChatMessage`` rendered by a
``ChatSession`` over that model, and the loss is taken on the assistant's replies only (their text and
``<|im_end|>``).

The data is generated here (fixed seeds, no internet): arithmetic asked in many phrasings (operands of 1
to 4 digits) -> a ``calculate`` call -> its result -> an answer quoting it; facts the user tells (name,
city, pet, favourite colour, job) asked later; questions about facts never told -> "I don't know";
a little small talk. ``HELDOUT`` holds names, cities, pets, jobs and phrasings training never sees
(``scripts/eval_smollm2_adapter.py`` plays dialogues of that world).

    python scripts/train_smollm2_adapter.py --out /tmp/smollm2-tools

runs the shipped adapter's steps (run 4 of docs/adapters.md: 300 steps of 4 dialogues, the rate decaying
from 2e-4 to 2e-5; about 5.5 s a step idle, 42 min on the loaded 2-core machine,
scripts/logs/train_smollm2_adapter-run4.log): the same data, order and initialisation on any machine.
``--minutes`` also bounds a run by wall clock. Checkpoints ``NNNNN_adapters.safetensors`` are written
beside the adapter every ``--save-every`` steps (scripts/eval_smollm2_adapter.py --adapter takes one).
"""

from __future__ import annotations

import argparse
import json
import math
import string
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import chatkit  # loads OpenBLAS before MLX
from chatkit import ChatMessage, ChatSession, ToolCall
from chatkit.demo import calculate
from chatkit.model.adapters import TOOL_FORMAT_KEY

import numpy as np

TOOL_PARSER = {"tool_parser_type": chatkit.demo.SMOLLM2_TOOL_PARSER}  # chatkit.load(..., **TOOL_PARSER)
SYSTEM_DEFAULT = None  # no instructions: SmolLM2's template adds its own system prompt

# ---------------------------------------------------------------------------------------------- worlds


@dataclass(frozen=True)
class World:
    """The vocabulary of one set of dialogues: training's or the held-out one."""

    names: tuple[str, ...]
    cities: tuple[str, ...]
    colours: tuple[str, ...]
    species: tuple[str, ...]
    pets: tuple[str, ...]
    jobs: tuple[str, ...]
    tell: dict[str, tuple[str, ...]]
    ask: dict[str, tuple[str, ...]]
    calc: tuple[str, ...]  # phrasings with {e}, the expression
    words: dict[str, tuple[str, ...]]  # phrasings with {a} and {b}, per operator
    invented: float = 0.0  # share of made-up names


def _syllable_name(rng: np.random.Generator) -> str:
    cons, vow = "bdfgklmnprstvz", "aeiou"
    n = int(rng.integers(2, 4))
    return "".join(str(rng.choice(list(cons))) + str(rng.choice(list(vow))) for _ in range(n)).capitalize()


TRAIN = World(
    names=tuple("""Ada Alice Amir Anna Arjun Ben Bianca Carlos Chen Chloe Daniel Diego Elena Emma Ethan Fatima
Felix Grace Hana Hugo Ibrahim Ines Isaac Jack James Jana Javier Julia Kai Karim Laura Leo Lena Liam Lucia Luis
Maria Marta Mateo Maya Mia Mohammed Nadia Nina Noah Oliver Olga Omar Oscar Paula Pedro Priya Rahul Rosa Ruby
Sam Sara Sofia Tariq Theo Tom Uma Victor Wei Yara Yusuf Zoe Adam Beth Cara Dmitri Erik Farah Gita Hiro Ivan Jonas
Kenji Lars Mei Nils Otto Petra Quinn Rita Sven Tara Ugo Vera Wanda Xavier Yuki Zara""".split()),
    cities=tuple("""Paris London Berlin Madrid Rome Lisbon Vienna Prague Warsaw Dublin Oslo Stockholm Helsinki
Athens Cairo Nairobi Lagos Tokyo Osaka Seoul Beijing Shanghai Mumbai Delhi Bangkok Jakarta Manila Sydney
Melbourne Auckland Toronto Vancouver Montreal Chicago Boston Denver Seattle Austin Miami Lima Bogota Santiago
Quito Havana Dakar Accra Tunis Istanbul Tehran Dubai Hanoi Kyoto Porto Seville Milan Naples Munich Hamburg
Zurich Geneva Lyon Marseille Brussels Antwerp Amsterdam Rotterdam Copenhagen Riga Vilnius Tallinn Krakow
Budapest Bucharest Sofia Belgrade Zagreb""".split()),
    colours=("red", "blue", "green", "yellow", "purple", "orange", "pink", "black", "white", "grey", "brown", "gold"),
    species=("dog", "cat", "rabbit", "parrot", "hamster", "goldfish", "horse"),
    pets=tuple("""Rex Bella Max Luna Charlie Daisy Rocky Coco Milo Lola Buddy Molly Toby Bailey Oreo Pepper Simba
Nala Ziggy Biscuit Shadow Ginger Rusty Maple Pickles Noodle Mochi Peanut Whiskers Bubbles""".split()),
    jobs=("teacher", "nurse", "doctor", "engineer", "baker", "pilot", "farmer", "lawyer", "chef", "painter",
          "plumber", "librarian", "architect", "accountant", "electrician", "dentist", "journalist", "gardener"),
    tell={
        "name": ("My name is {v}.", "I'm {v}.", "Call me {v}.", "Hi, I am {v}.", "Hello! {v} here.", "Hey, my name's {v}.",
                 "Everyone calls me {v}.", "This is {v} speaking.", "I go by {v}.", "{v} is my name.", "Good morning, I'm {v}."),
        "city": ("I live in {v}.", "I'm from {v}.", "My home is in {v}.", "I live in the city of {v}.", "I'm based in {v}.",
                 "I recently moved to {v}.", "Home for me is {v}.", "I grew up in {v} and still live there.", "I've lived in {v} for years."),
        "pet": ("I have a {s} called {v}.", "My {s} is named {v}.", "I have a {s} named {v}.", "My {s}'s name is {v}.",
                "{v} is the name of my {s}.", "I own a {s}; its name is {v}.", "Our family {s} is called {v}."),
        "colour": ("My favourite colour is {v}.", "I love the colour {v}.", "My favorite color is {v}.", "{v} is the colour I like most.",
                   "My favourite color has always been {v}.", "I really like {v}, it's my favourite colour."),
        "job": ("I work as {a} {v}.", "I'm {a} {v}.", "My job is {v}.", "I'm {a} {v} by profession.", "I have a job as {a} {v}.",
                "I've been {a} {v} for ten years.", "At work I'm {a} {v}."),
    },
    ask={
        "name": ("What is my name?", "Do you remember my name?", "What's my name?", "Who am I?", "Do you know my name?",
                 "What did I tell you my name is?", "Tell me my name.", "What was my name again?", "Have I told you my name?",
                 "Which name did I give you?", "Can you recall my name?"),
        "city": ("Where do I live?", "Which city do I live in?", "Where am I from?", "What city is my home?",
                 "Do you know where I live?", "What did I tell you about where I live?", "Tell me where I live.",
                 "Which city did I say I live in?", "Where is my home?", "Can you recall my city?"),
        "pet": ("What is my pet's name?", "What's my pet called?", "What is the name of my pet?", "Do you know my pet's name?",
                "What did I tell you my pet is called?", "Tell me my pet's name.", "What was my pet's name again?",
                "Which name does my pet have?", "Can you recall what my pet is called?"),
        "colour": ("What is my favourite colour?", "Which colour do I like best?", "What's my favorite color?",
                   "Do you know my favourite colour?", "What did I tell you my favourite colour is?", "Tell me my favourite colour.",
                   "Which colour did I tell you I like?", "What colour do I love most?", "Can you recall my favourite colour?"),
        "job": ("What is my job?", "What do I do for work?", "What's my job?", "Do you know what I do for a living?",
                "What did I tell you about my work?", "Tell me what my job is.", "What is my profession?",
                "Which job did I say I have?", "Can you recall what I do for work?"),
    },
    calc=("What is {e}?", "Calculate {e}.", "How much is {e}?", "Can you work out {e}?", "{e} = ?",
          "Please compute {e}.", "what's {e}", "Compute {e} for me.", "Solve {e}.", "{e}?"),
    words={
        "+": ("What is {a} plus {b}?", "Add {a} and {b}.", "What do you get if you add {a} to {b}?"),
        "-": ("What is {a} minus {b}?", "Take {b} away from {a}.", "How much is {a} minus {b}?"),
        "*": ("What is {a} times {b}?", "Multiply {a} by {b}.", "What do you get if you multiply {a} by {b}?"),
        "/": ("What is {a} divided by {b}?", "Divide {a} by {b}.", "How much is {a} divided by {b}?",
              "How many times does {b} go into {a}?", "Share {a} equally between {b}.", "What is {a} split {b} ways?"),
    },
    invented=0.25,
)

HELDOUT = World(
    names=tuple("""Aurora Bastian Cosima Desmond Elodie Florian Gideon Helga Ingrid Jasper Kasimir Linnea Magnus
Niamh Ottilie Percival Rosalind Soren Thaddeus Ulrike Valentina Wilhelmina Ximena Yannick Zephyr""".split()),
    cities=tuple("""Reykjavik Ljubljana Tbilisi Yerevan Almaty Ulaanbaatar Kathmandu Colombo Muscat Windhoek Maputo
Kampala Asuncion Montevideo Valparaiso Halifax Anchorage Honolulu Hobart Perth""".split()),
    colours=("teal", "turquoise", "crimson", "lavender", "indigo", "beige"),
    species=("tortoise", "ferret", "canary", "guinea pig"),
    pets=tuple("Waffles Pixel Clementine Bramble Nugget Sprocket Tofu Marzipan Juniper Ravioli".split()),
    jobs=("carpenter", "veterinarian", "pharmacist", "translator", "firefighter", "photographer", "astronomer"),
    tell={
        "name": ("People call me {v}.", "The name's {v}.", "You can call me {v}."),
        "city": ("I moved to {v} last year.", "These days I live in {v}.", "My flat is in {v}."),
        "pet": ("I've got a {s} named {v}.", "{v} is my {s}.", "We adopted a {s}, {v}."),
        "colour": ("{v} is my favourite colour.", "I like {v} best of all colours.", "The colour I love most is {v}."),
        "job": ("I earn my living as {a} {v}.", "By trade I am {a} {v}.", "For work I'm {a} {v}."),
    },
    ask={
        "name": ("What did I say my name was?", "Can you tell me my name?", "Remind me, what am I called?"),
        "city": ("Do you remember where I live?", "Remind me which city I live in.", "In which city is my home?"),
        "pet": ("Do you remember my pet's name?", "What did I say my pet is called?", "Remind me of my pet's name."),
        "colour": ("Do you remember my favourite colour?", "Which colour did I say I love?", "Remind me of my favourite colour."),
        "job": ("Do you remember my job?", "What did I say I do for a living?", "Remind me what my job is."),
    },
    calc=("Quick question: what is {e}?", "I need {e} worked out.", "Could you tell me what {e} is?",
          "Work this out please: {e}", "Help me with {e}."),
    words={
        "+": ("What's the sum of {a} and {b}?", "If I add {a} and {b}, what do I get?"),
        "-": ("Subtract {b} from {a}.", "What's the difference between {a} and {b}?"),
        "*": ("What is the product of {a} and {b}?", "What's {a} multiplied by {b}?"),
        "/": ("Tell me {a} divided by {b}.", "What is {a} over {b}?"),
    },
    invented=0.3,
)

KINDS = ("name", "city", "pet", "colour", "job")
ACK = {
    "name": ("Nice to meet you, {v}!", "Hello, {v}! How can I help you today?"),
    "city": ("{v} sounds like a lovely place to live.", "Got it: you live in {v}."),
    "pet": ("{v} sounds like a wonderful {s}!", "What a nice name for a {s}: {v}."),
    "colour": ("{V} is a great colour!", "Noted: your favourite colour is {v}."),
    "job": ("Being {a} {v} sounds interesting!", "Got it: you work as {a} {v}."),
}
RECALL = {
    "name": "Your name is {v}.",
    "city": "You live in {v}.",
    "pet": "Your {s} is called {v}.",
    "colour": "Your favourite colour is {v}.",
    "job": "You work as {a} {v}.",
}
UNTOLD = {
    "name": "I don't know your name: you haven't told me yet.",
    "city": "I don't know where you live: you haven't told me.",
    "pet": "I don't know your pet's name: you haven't told me about a pet.",
    "colour": "I don't know your favourite colour: you haven't told me.",
    "job": "I don't know what your job is: you haven't told me.",
}
CHAT = (
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there", "Hi! What can I do for you?"),
    ("How are you?", "I'm doing well, thank you! How can I help you?"),
    ("Thanks!", "You're welcome!"),
    ("Thank you very much.", "You're welcome! Let me know if you need anything else."),
    ("Tell me a joke.", "Why don't scientists trust atoms? Because they make up everything!"),
    ("What can you do?", "I can chat with you, remember what you tell me, and do arithmetic with my calculator tool."),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What colour is the sky?", "On a clear day the sky is blue."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("Good night!", "Good night! Sleep well."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet."),
    ("What is water made of?", "Water is made of hydrogen and oxygen: H2O."),
    ("Can you help me?", "Of course! What do you need help with?"),
)

# ------------------------------------------------------------------------------------------- dialogues


@dataclass
class Turn:
    """One user message and the replies expected to it (a call, its result and the answer, or one reply)."""

    user: str
    replies: list[ChatMessage]
    task: str  # "arithmetic", "recall", "untold", "chat", "tell"
    expected: str = ""  # arithmetic: the result; recall and tell: the fact's value
    expression: str = ""
    phrasing: str = ""


@dataclass
class Dialogue:
    turns: list[Turn] = field(default_factory=list)

    def messages(self) -> list[ChatMessage]:
        out: list[ChatMessage] = []
        for t in self.turns:
            out.append(ChatMessage.user(t.user))
            out.extend(t.replies)
        return out


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def operand(rng: np.random.Generator) -> int:
    digits = int(rng.choice([1, 2, 3, 4], p=[0.15, 0.3, 0.3, 0.25]))
    return int(rng.integers(10 ** (digits - 1) if digits > 1 else 0, 10**digits))


def call_id(rng: np.random.Generator) -> str:
    chars = string.ascii_letters + string.digits
    return "".join(str(rng.choice(list(chars))) for _ in range(9))


def arithmetic(rng: np.random.Generator, world: World) -> Turn:
    op = str(rng.choice(["+", "-", "*", "/"], p=[0.3, 0.25, 0.25, 0.2]))
    a, b = operand(rng), operand(rng)
    if op == "/":
        b = max(b, 1) if rng.random() < 0.3 else max(b % 100, 2)
        if rng.random() < 0.7:  # mostly whole results
            a = b * int(rng.integers(1, max(2, 10000 // b)))
    if rng.random() < 0.2 and op != "/":  # three operands
        c, op2 = operand(rng), str(rng.choice(["+", "-", "*"]))
        expression = f"{a} {op} {b} {op2} {c}"
        user = str(rng.choice(world.calc)).format(e=expression)
    else:
        expression = f"{a} {op} {b}"
        if rng.random() < 0.35:
            user = str(rng.choice(world.words[op])).format(a=a, b=b)
        else:
            shown = expression.replace("*", str(rng.choice(["*", "x", "×"]))) if op == "*" else expression
            if rng.random() < 0.2:
                shown = shown.replace(" ", "")
            user = str(rng.choice(world.calc)).format(e=shown)
    if rng.random() < 0.15:
        user = user.lower()
    result = calculate(expression)
    cid = call_id(rng)
    replies = [
        ChatMessage.assistant("", tool_calls=[ToolCall(cid, "calculate", {"expression": expression})]),
        ChatMessage.tool(result, tool_call_id=cid, name="calculate"),
        ChatMessage.assistant(f"{expression} = {result}."),
    ]
    return Turn(user, replies, "arithmetic", expected=result, expression=expression)


def fact(rng: np.random.Generator, world: World, kind: str) -> dict[str, str]:
    species = str(rng.choice(world.species))
    if kind == "name":
        v = _syllable_name(rng) if rng.random() < world.invented else str(rng.choice(world.names))
    elif kind == "city":
        v = str(rng.choice(world.cities))
    elif kind == "pet":
        v = _syllable_name(rng) if rng.random() < world.invented else str(rng.choice(world.pets))
    elif kind == "colour":
        v = str(rng.choice(world.colours))
    else:
        v = str(rng.choice(world.jobs))
    return {"v": v, "V": v.capitalize(), "s": species, "a": article(v)}


def tell(rng: np.random.Generator, world: World, kind: str, f: dict[str, str]) -> Turn:
    user = str(rng.choice(world.tell[kind])).format(**f)
    if user[0].islower():
        user = user[0].upper() + user[1:]
    return Turn(user, [ChatMessage.assistant(str(rng.choice(ACK[kind])).format(**f))], "tell", expected=f["v"])


def recall(rng: np.random.Generator, world: World, kind: str, f: dict[str, str]) -> Turn:
    phrasing = str(rng.choice(world.ask[kind]))
    return Turn(phrasing, [ChatMessage.assistant(RECALL[kind].format(**f))], "recall", expected=f["v"], phrasing=phrasing)


def untold(rng: np.random.Generator, world: World, kind: str) -> Turn:
    phrasing = str(rng.choice(world.ask[kind]))
    return Turn(phrasing, [ChatMessage.assistant(UNTOLD[kind])], "untold", phrasing=phrasing)


def chat(rng: np.random.Generator) -> Turn:
    user, reply = CHAT[int(rng.integers(len(CHAT)))]
    return Turn(user, [ChatMessage.assistant(reply)], "chat")


def filler(rng: np.random.Generator, world: World) -> Turn:
    return arithmetic(rng, world) if rng.random() < 0.6 else chat(rng)


def one_fact(rng: np.random.Generator, world: World, kinds: list[str]) -> Dialogue:
    """One fact told, then asked at once (and, half the time, another one never told): the plainest recall."""
    f = fact(rng, world, kinds[0])
    questions = [recall(rng, world, kinds[0], f)] + ([untold(rng, world, kinds[1])] if rng.random() < 0.5 else [])
    return Dialogue([tell(rng, world, kinds[0], f)] + [questions[int(i)] for i in rng.permutation(len(questions))])


def make_dialogue(rng: np.random.Generator, world: World) -> Dialogue:
    """Arithmetic dialogues (40 %), one-fact dialogues (15 %) or memory dialogues: up to three facts told,
    other turns, then some of them asked and (70 % of the time) one never told."""
    d = Dialogue()
    if rng.random() < 0.4:
        for _ in range(int(rng.integers(1, 3))):
            d.turns.append(arithmetic(rng, world) if rng.random() < 0.85 else chat(rng))
        return d
    kinds = [str(k) for k in rng.permutation(KINDS)]
    if rng.random() < 0.25:
        return one_fact(rng, world, kinds)
    told = kinds[: int(rng.integers(1, 4))]
    facts = {k: fact(rng, world, k) for k in told}
    if rng.random() < 0.2:
        d.turns.append(filler(rng, world))
    for k in told:
        d.turns.append(tell(rng, world, k, facts[k]))
        if rng.random() < 0.2:
            d.turns.append(filler(rng, world))
    questions = [recall(rng, world, k, facts[k]) for k in rng.permutation(told)[: int(rng.integers(1, len(told) + 1))]]
    if rng.random() < 0.7:  # one question at most about a fact never told: more tilts it towards refusing
        questions.append(untold(rng, world, kinds[len(told)]))
    for i in rng.permutation(len(questions)):
        if rng.random() < 0.15:
            d.turns.append(filler(rng, world))
        d.turns.append(questions[int(i)])
    return d


# ------------------------------------------------------------------------------------------- rendering

ASSISTANT_HEADER = "<|im_start|>assistant\n"
END = "<|im_end|>"


def render(lm: chatkit.LoadedModel, messages: list[ChatMessage], *, check: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text as chatkit renders it for SmolLM2 with the demo's tools, and the character
    spans of the assistant's replies (their text and ``<|im_end|>``: what the model writes). ``check``:
    also render every prefix ending before a reply and check it is where the reply starts."""

    def text(history: list[ChatMessage]) -> str:
        return ChatSession.builder(lm).tools(chatkit.demo.tools()).history(history).build().render()

    full = text(messages)
    spans, at = [], 0
    while (at := full.find(ASSISTANT_HEADER, at)) >= 0:
        at += len(ASSISTANT_HEADER)
        spans.append((at, full.index(END, at) + len(END)))
    if check:
        starts = [len(text(messages[:i])) + len(ASSISTANT_HEADER) for i, m in enumerate(messages) if i and m.role.value == "assistant"]
        if starts != [s for s, _ in spans] or any(not full.startswith(text(messages[:i])) for i in range(1, len(messages))):
            raise RuntimeError(f"the replies are not where chatkit renders them:\n{full!r}")
    return full, spans


def encode(lm: chatkit.LoadedModel, messages: list[ChatMessage], check: bool = False) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 mask: 1 where the token is the assistant's."""
    full, spans = render(lm, messages, check=check)
    enc = lm.tokenizer._tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [int(any(s <= start < e for s, e in spans)) for start, _ in offsets]
    return ids, mask


# -------------------------------------------------------------------------------------------- training


def dataset(lm: chatkit.LoadedModel, n: int, seed: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng([seed, 1])
    out: list[tuple[list[int], list[int]]] = []
    while len(out) < n:
        ids, mask = encode(lm, make_dialogue(rng, TRAIN).messages(), check=len(out) < 50)
        if len(ids) <= max_tokens:
            out.append((ids, mask))
    return out


def batches(data: list[tuple[list[int], list[int]]], batch_size: int, seed: int):
    """Batches of similar lengths (padded to a multiple of 32: few shapes to compile), in a seeded order."""
    import mlx.core as mx

    rng = np.random.default_rng([seed, 2])
    order = np.argsort([len(ids) for ids, _ in data], kind="stable")
    groups = [order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
    while True:
        for g in rng.permutation(len(groups)):
            rows = [data[int(i)] for i in groups[int(g)]]
            width = int(math.ceil(max(len(ids) for ids, _ in rows) / 32) * 32)
            tokens = np.zeros((len(rows), width), np.int32)
            mask = np.zeros((len(rows), width), np.float32)
            for r, (ids, m) in enumerate(rows):
                tokens[r, : len(ids)], mask[r, : len(m)] = ids, m
            yield mx.array(tokens), mx.array(mask)


def masked_loss(model, tokens, targets, where):
    """Cross-entropy of the assistant's tokens only: the body runs over the whole batch, the output layer
    only at the positions ``where`` (flat indices of the positions that predict an assistant token)."""
    import mlx.core as mx
    import mlx.nn as nn

    hidden = model.model(tokens)
    hidden = hidden.reshape(-1, hidden.shape[-1])[where]
    logits = model.model.embed_tokens.as_linear(hidden) if model.args.tie_word_embeddings else model.lm_head(hidden)
    return nn.losses.cross_entropy(logits.astype(mx.float32), targets).mean()


def step_inputs(tokens, mask):
    """The loss's inputs for a padded batch: the tokens but the last, the assistant tokens to predict and
    the flat positions predicting them."""
    import mlx.core as mx

    tokens, mask = np.array(tokens), np.array(mask)
    inputs, predicted = tokens[:, :-1], mask[:, 1:].reshape(-1) > 0
    where = np.nonzero(predicted)[0].astype(np.int32)
    return mx.array(inputs), mx.array(tokens[:, 1:].reshape(-1)[where]), mx.array(where)


def schedule(args: argparse.Namespace):
    """Warm up over 8 steps, then a cosine from ``--lr`` down to ``--final-lr`` (equal: a constant rate)."""
    import mlx.optimizers as optim

    warmup = 8
    decay = optim.cosine_decay(args.lr, max(args.max_iters - warmup, 1), args.final_lr)
    return optim.join_schedules([optim.linear_schedule(args.lr / 10, args.lr, warmup), decay], [warmup])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the adapter folder to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--examples", type=int, default=1600)
    p.add_argument("--minutes", type=float, default=None, help="stop after this long (wall clock), then save")
    p.add_argument("--max-iters", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=320)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--scale", type=float, default=10.0)
    p.add_argument("--layers", type=int, default=10, help="adapt the last N of the 30 layers")
    p.add_argument("--keys", default="self_attn.q_proj,self_attn.k_proj,self_attn.v_proj,self_attn.o_proj,"
                   "mlp.gate_proj,mlp.up_proj,mlp.down_proj")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--final-lr", type=float, default=2e-5,
                   help="the rate at the last step: a cosine from --lr over --max-iters steps (--lr: constant)")
    p.add_argument("--save-every", type=int, default=10)
    args = p.parse_args(argv)

    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    mx.random.seed(args.seed)
    t0 = time.perf_counter()
    lm = chatkit.load("smollm2", **TOOL_PARSER)
    data = dataset(lm, args.examples, args.seed, args.max_tokens)
    lengths = [len(ids) for ids, _ in data]
    print(f"{len(data)} dialogues, tokens mean {np.mean(lengths):.0f} max {max(lengths)}, "
          f"assistant tokens {sum(sum(m) for _, m in data)}; built in {time.perf_counter() - t0:.0f} s", flush=True)
    print(render(lm, make_dialogue(np.random.default_rng([args.seed, 9]), TRAIN).messages())[0], flush=True)

    model = lm.model
    model.freeze()
    lora = {"rank": args.rank, "scale": args.scale, "dropout": 0.0, "keys": args.keys.split(",")}
    linear_to_lora_layers(model, args.layers, lora)
    n_train = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    print(f"LoRA rank {args.rank} on the last {args.layers} layers ({args.keys}): {n_train / 1e6:.2f}M parameters", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    config = {"fine_tune_type": "lora", "num_layers": args.layers, "lora_parameters": lora,
              TOOL_FORMAT_KEY: TOOL_PARSER["tool_parser_type"],  # sessions using the adapter read this format
              "chatkit_training": {k: v for k, v in vars(args).items() if k != "out"}}  # where it was written: no use
    (args.out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")

    opt = optim.Adam(learning_rate=schedule(args))
    loss_and_grad = nn.value_and_grad(model, masked_loss)

    def save(name: str) -> None:
        mx.save_safetensors(str(args.out / name), dict(tree_flatten(model.trainable_parameters())))

    model.train()
    start, losses = time.perf_counter(), []
    for it, (tokens, mask) in enumerate(batches(data, args.batch_size, args.seed), start=1):
        loss, grads = loss_and_grad(model, *step_inputs(tokens, mask))
        opt.update(model, grads)
        mx.eval(model.trainable_parameters(), opt.state, loss)
        losses.append(loss.item())
        elapsed = time.perf_counter() - start
        print(f"iter {it}: loss {losses[-1]:.3f} (last 10: {np.mean(losses[-10:]):.3f}), "
              f"{elapsed / it:.1f} s/step, {elapsed / 60:.1f} min", flush=True)
        if it % args.save_every == 0:
            save(f"{it:05d}_adapters.safetensors")
        if (args.minutes is not None and elapsed > args.minutes * 60) or it >= args.max_iters:
            break
    save("adapters.safetensors")
    print(f"done: {it} steps in {(time.perf_counter() - start) / 60:.1f} min; adapter in {args.out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
