"""Train chatkit's bundled demo pair (``chatkit/demo/models``): a small chat model that remembers facts
of any spelling, calls a ``calculate`` tool and is trained to fill JSON forms, and a draft model for it.

Everything is synthetic and reproducible from ``--seed``:

1. multi-turn dialogues (1 to 28 turns) in a small world: facts the user tells (name, city,
   favourite colour, pet; most of them made-up strings, so the model learns to copy rather than to
   recall a list) and asks back later in many phrasings, questions about facts never told ("I don't
   know"), arithmetic through a ``calculate`` tool call whose result the answer copies, JSON forms
   (a JSON Schema appended to the message, as ``respond(..., output=...)`` sends it), spelling,
   letter counts, repeating words, small talk and polite refusals; a system prompt in some, the
   tool in most. A held-out world (``HELDOUT``: other names, cities, colours, pets, phrasings) is
   for evaluation only;
2. a byte-level BPE tokenizer (``tokenizers``) with ChatML specials, ``<tool_call>`` markers and
   single-digit numbers (any text can be written), whose pre-tokenizer splits a word the user tells
   after its first letter, so that a value is the same tokens in a message, a reply and a JSON string;
3. two qwen3-architecture models (mlx-lm's own classes) trained with MLX on the same batches, loss on
   the assistant's tokens only (its replies, tool calls and closing ``<|im_end|>``), in three phases:
   synthetic copying (random token strings repeated: the induction circuit that copying names
   needs forms here), short dialogues that are mostly telling and recalling, then the full mix;
4. both saved as folders ``mlx_lm.load`` / ``chatkit.load`` read.

The two models train at the same time in two processes, one core and one BLAS thread each (on 2
cores two BLAS threads made one model only ~7 % faster). See docs/demo.md for the measured run::

    python scripts/train_demo.py                       # writes chatkit/demo/models/{chat,draft}
    python scripts/train_demo.py --out /tmp/demo       # anywhere else

``scripts/eval_demo.py --models chatkit/demo/models`` plays held-out dialogues (``make_dialogue`` in the
held-out world, another seed) through ``chatkit.ChatSession``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

# One BLAS thread per process: the two models train side by side, and a fixed thread count keeps
# the float sums, so the weights, the same from run to run. Set before OpenBLAS loads.
os.environ["OPENBLAS_NUM_THREADS"] = "1"
if sys.platform.startswith("linux"):
    # glibc returns MLX's large per-step buffers to the kernel and faults them in again each step:
    # keeping them (trim and mmap thresholds up) made training steps 4-12 % faster here.
    import ctypes

    _libc = ctypes.CDLL(None)
    _libc.mallopt(-3, 32 * 1024 * 1024)  # M_MMAP_THRESHOLD (its maximum)
    _libc.mallopt(-1, 1024 * 1024 * 1024)  # M_TRIM_THRESHOLD
    _libc.mallopt(-2, 256 * 1024 * 1024)  # M_TOP_PAD

import chatkit  # noqa: E402,F401  (loads OpenBLAS before MLX: float32 training is ~10x faster)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
from mlx_lm.utils import get_total_parameters  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "chatkit" / "demo" / "models"

# --------------------------------------------------------------------------------------------
# The synthetic world
# --------------------------------------------------------------------------------------------
# Every list comes in two parts: what training sees and what only the evaluation sees (held-out
# names, cities, colours, pets and phrasings). Most training names are random strings (syllables or
# letters, any capitalization, accents, apostrophes, hyphens), so the model learns to copy what the
# user said rather than to recall a list.

NAMES = """Ada Alan Grace Linus Marie Nina Omar Priya Yuki Leo Sara Tom Emma Noah Olivia Liam Mia Lucas
Zoe Ivan Elena Hugo Ines Kai Lena Max Nora Oscar Paula Quinn Rosa Sam Tara Uma Victor Wendy Xavier
Yara Zack Aiko Bruno Chloe Diego Eva Felix Gina Hana Igor Jade Karl Lara Mateo Nadia Otto Pia Raul
Theo Vera Will Yusuf Zara Amir Bea Carlos Dara Erik Fatima Gus Hiro Isla Jonas Kira Luca Maya Nils
Olga Pedro Rita Sven Tina Ugo Wanda Yves Anna Ben Clara Dan Ella Finn Greta Hans Iris Jack Kate Leon
Mona Nick Pablo Ruth Simon Tess Vince Amelia Boris Cyrus Dora Edgar Flora Gabriel Helga Irene
Jasper Keiko Lorenzo Mirela Nikolai Ophelia Rafael Selma Tobias Valentina Wilhelm Zainab José Zoë
Björn Siân O'Hara Jean-Luc Anne-Marie McKenzie DeShawn Łukasz Søren Ngozi Oluwaseun Xiomara""".split()
HELDOUT_NAMES = """Noor Kenji Siobhan Thandiwe Aleksandr Mei-Ling Giuseppe Ximena Tupac Eitan Rhiannon
Zbigniew Aoife Kwame Ingrid Rashid Yevgenia Tomasz Marisol Dagny Femi Hyun-woo Émilie Øystein Ptolemy
Quetzal Brönte Lachlan Saoirse Vuk Zephyrine Kaito Bartholomew Ifeoma Mads Nguyen Oisín Parveen Renée
Tadeusz Ulla Wojciech Yolanda Zaid Anouk Caoimhe D'Angelo Esperanza Florentyna Gwendolyn""".split()

CITIES = """Lyon Paris Berlin Tokyo Lima Oslo Rome Cairo Delhi Seoul Madrid Lisbon Vienna Prague Dublin
Boston Denver Austin Toronto Sydney Nairobi Lagos Hanoi Bangkok Manila Quito Bogota Havana Athens
Warsaw Helsinki Zurich Geneva Munich Hamburg Milan Naples Porto Seville Valencia Montreal Chicago
Seattle Portland Kyoto Osaka Busan Mumbai Dhaka Riga Tallinn Vilnius Bern Ghent Leeds York Glasgow
Krakow Marseille Bordeaux Nantes Turin Florence Stockholm Copenhagen Reykjavik Santiago São_Paulo
New_York Los_Angeles Buenos_Aires Rio_de_Janeiro Kraków Zürich Málaga""".split()
HELDOUT_CITIES = """Ouagadougou Thessaloniki Ljubljana Antananarivo Wellington Cusco Tbilisi Yerevan
Almaty Bratislava Windhoek Kyiv Brisbane Halifax Winnipeg Da_Nang Cluj-Napoca Łódź Gdańsk Göteborg
Aarhus Trondheim Düsseldorf Bilbao Salvador Medellín Guadalajara Valparaíso Hobart Dunedin Nagoya
Sapporo Kathmandu Ulaanbaatar Timbuktu Marrakesh Zanzibar St._Petersburg Kuala_Lumpur Le_Havre
Saint-Étienne Baton_Rouge""".split()

COLOURS = """red blue green yellow orange purple pink brown black white grey gold silver teal violet
indigo cyan beige maroon navy olive coral amber ivory lilac khaki plum rust salmon jade""".split()
HELDOUT_COLOURS = """vermilion chartreuse ultramarine mauve ochre cerulean magenta turquoise lavender
crimson scarlet emerald sapphire cobalt periwinkle fuchsia tangerine aquamarine burgundy sepia""".split()
SHADES = ["light", "dark", "pale", "bright", "deep", "sky", "forest", "royal", "hot", "baby"]

PETS = "dog cat rabbit parrot hamster turtle horse goldfish snake lizard mouse pony".split()
HELDOUT_PETS = "ferret hedgehog tortoise canary guinea_pig iguana".split()
CITIES, HELDOUT_CITIES, HELDOUT_PETS = ([w.replace("_", " ") for w in ws] for ws in (CITIES, HELDOUT_CITIES, HELDOUT_PETS))

WORDS = """cat dog sun moon tree book fish bird apple lemon house water river cloud chair table bread
milk cake rain snow wind fire stone grass leaf road ship boat train plane car bike door window
garden flower horse mouse tiger lion zebra panda koala eagle shark whale frog snake bee ant owl
bear wolf fox duck goat sheep cow pig hat shoe sock coat ring key lamp clock phone paper pencil
music song dance dream smile heart hand foot head nose mouth eye ear hair night day summer winter
spring autumn morning island forest desert ocean beach hill valley bridge castle tower city town
king queen robot rocket planet star sugar salt honey butter cheese pizza pasta rice soup tea
coffee juice orange banana grape melon peach cherry plum pear olive carrot potato tomato onion""".split()

SYLLABLES = """ka ki ko ku ma mi mo na ni no ta te to ra ri ro sa si so la li lo da de do ba be bo ga go
ha he ho ja jo va ve vi za zo pa pe pi fa fe fi ya yo wa we an en in on ar er or el al il ash ek ix
uz ay ey oi au ou ia io ea th sh ch tr br kr st sk pl gl dr fl gr""".split()
ACCENTED = dict(a="áàâäå", e="éèêë", i="íîï", o="óôöø", u="úûü", n="ñ", c="ç")


def random_word(rng: np.random.Generator) -> str:
    """A made-up word: syllables or random letters, 2 to 12 letters."""
    if rng.random() < 0.75:
        word = "".join(str(s) for s in rng.choice(SYLLABLES, size=int(rng.integers(1, 5))))
    else:
        word = "".join(chr(ord("a") + int(i)) for i in rng.integers(0, 26, size=int(rng.integers(2, 10))))
    if rng.random() < 0.12:
        i = int(rng.integers(len(word)))
        if word[i] in ACCENTED:
            word = word[:i] + str(rng.choice(list(ACCENTED[word[i]]))) + word[i + 1 :]
    if rng.random() < 0.04:  # any Latin letter: names may hold letters the lists never show
        i = int(rng.integers(len(word)))
        word = word[:i] + chr(int(rng.integers(0xC0, 0x17F))) + word[i + 1 :]
    return word[:12]


def random_name(rng: np.random.Generator) -> str:
    """A made-up proper name in a random spelling style."""
    word = random_word(rng)
    style = rng.random()
    if style < 0.72:
        name = word.capitalize()
    elif style < 0.8:
        name = word
    elif style < 0.84:
        name = word.upper()
    elif style < 0.9:
        name = f"{rng.choice(['Mc', 'De', 'Van', 'La', 'Mac', 'Di'])}{word.capitalize()}"
    elif style < 0.95:
        name = f"{word.capitalize()}{rng.choice(['-', chr(39)])}{random_word(rng).capitalize()}"
    else:
        name = f"{word.capitalize()} {random_word(rng).capitalize()}"
    return name


@dataclass(frozen=True)
class World:
    """What a dialogue may contain: the training world, or the held-out one the evaluation uses."""

    names: list[str]
    cities: list[str]
    colours: list[str]
    pets: list[str]
    tell: dict[str, list[str]]
    ask: dict[str, list[str]]
    calc: list[str]
    guided: list[str]
    made_up: float  # the share of names and cities that are random strings
    made_up_colour: float  # ... of colours
    made_up_pet: float  # ... of the kinds of pets
    decimals: float  # the share of arithmetic operands with decimals
    adverbs: tuple[str, ...] = ()  # inserted after "I" in some telling messages ("I also live in ...")

    def name(self, rng: np.random.Generator) -> str:
        return random_name(rng) if rng.random() < self.made_up else str(rng.choice(self.names))

    def city(self, rng: np.random.Generator) -> str:
        if rng.random() >= self.made_up:
            return str(rng.choice(self.cities))
        city = random_name(rng)
        r = rng.random()
        if r < 0.1:
            return f"{rng.choice(['New', 'San', 'Port', 'Saint', 'Fort', 'Lake'])} {city}"
        if r < 0.15:
            return f"{city} {rng.choice(['City', 'Springs', 'Bay', 'Falls'])}"
        return city

    def colour(self, rng: np.random.Generator) -> str:
        r = rng.random()
        if r < self.made_up_colour:
            return random_word(rng)
        colour = str(rng.choice(self.colours))
        return f"{rng.choice(SHADES)} {colour}" if r > 0.85 else colour

    def pet(self, rng: np.random.Generator) -> str:
        return random_word(rng) if rng.random() < self.made_up_pet else str(rng.choice(self.pets))


TELL = {
    "name": ["My name is {v}.", "I am {v}.", "I'm {v}.", "Call me {v}.", "You can call me {v}.", "My name's {v}.",
             "Hi, I'm {v}.", "Hello, my name is {v}.", "I am called {v}.", "People call me {v}.", "Name's {v}.",
             "Hey! I'm {v}.", "My first name is {v}.", "I go by {v}.", "Please call me {v}.", "{v} is my name.",
             "Just call me {v}.", "Hi! My name is {v}.", "Hello, I am {v}.", "My friends call me {v}.",
             "I'm known as {v}.", "They call me {v}.", "This is {v}.", "It's {v} here.", "My name: {v}.",
             "Everybody knows me as {v}.", "You may call me {v}.", "I am {v}, by the way.", "{v} here.",
             "{v}, that's me.", "{v} is what people call me.", "{v} is how people know me.",
             "I'd like you to call me {v}.", "So, I am {v}."],
    "city": ["I live in {v}.", "I'm from {v}.", "I am from {v}.", "My home town is {v}.", "I moved to {v}.",
             "My city is {v}.", "I'm based in {v}.", "Home for me is {v}.", "I reside in {v}.", "I live in {v} now.",
             "My town is {v}.", "I'm living in {v}.", "I stay in {v}.", "I grew up in {v}.", "I was born in {v}.",
             "I'm a resident of {v}.", "Right now I live in {v}.", "My home is in {v}.", "I moved here to {v}.",
             "{v} is where I live.", "{v} is my home.", "{v} is my city.", "{v} is my home town.",
             "{v} is the city I live in.", "I have a flat in {v}.",
             "My house is in {v}.", "At the moment I live in {v}.", "I currently live in {v}."],
    "colour": ["My favourite colour is {v}.", "My favorite color is {v}.", "I like the colour {v}.",
               "I love the color {v}.", "{v} is my favourite colour.", "My favourite colour? {v}.",
               "The colour I like best is {v}.", "I like {v} best.", "My favourite colour is {v}, I think.",
               "I adore the colour {v}.", "{v} is the colour I like most.", "My best colour is {v}.",
               "The color I love is {v}.", "My favourite color? It's {v}.", "{v}, that's my favourite colour.",
               "{v} is my best colour.", "{v} is the color I like best.", "{v} is the colour I prefer.", "I'm a fan of the colour {v}.", "I prefer the color {v}.",
               "The best colour is {v}.", "My favourite colour would be {v}.", "I like the color {v} a lot."],
    "pet": ["My {a} is called {v}.", "I have a {a} named {v}.", "My {a}'s name is {v}.", "I have a {a} called {v}.",
            "Our {a} is named {v}.", "My pet {a} is {v}.", "I've got a {a} called {v}.", "My {a} is named {v}.",
            "I keep a {a} called {v}.", "There's a {a} at home named {v}.", "Our family {a} is {v}.",
            "I've a {a} named {v}.", "My {a} answers to {v}.", "We got a {a} and named it {v}.",
            "{v} is my {a}.", "{v} is the name of my {a}.", "{v} is what I call my {a}.", "My {a} has the name {v}.",
            "I've got a pet {a}, {v}.",
            "At home I have a {a} called {v}.", "My little {a} is called {v}.", "My {a}'s called {v}."],
}
HELDOUT_TELL = {
    "name": ["Hi there, I am {v}.", "Everyone calls me {v}.", "I'm called {v}.", "The name is {v}.",
             "Hello! My name's {v}.", "Hey, call me {v}."],
    "city": ["These days I live in {v}.", "I come from {v}.", "My hometown is {v}.", "I am living in {v}."],
    "colour": ["I really like the colour {v}.", "My favorite colour is {v}.", "{v} is my favorite color."],
    "pet": ["I own a {a} named {v}.", "We have a {a} called {v}.", "My {a} goes by {v}."],
}
# The second half of "My name is Ada and I live in Oslo."
AND_TELL = {
    "name": ["my name is {v}", "I'm {v}", "you can call me {v}"],
    "city": ["I live in {v}", "I'm from {v}", "I am from {v}"],
    "colour": ["my favourite colour is {v}", "I like the colour {v}", "my favorite color is {v}"],
    "pet": ["I have a {a} named {v}", "my {a} is called {v}"],
}
TELL_REPLY = {
    "name": "Nice to meet you, {v}.",
    "city": "Noted: you live in {v}.",
    "colour": "Noted: your favourite colour is {v}.",
    "pet": "Noted: your {a} is called {v}.",
}
ASK = {
    "name": ["What is my name?", "What's my name?", "Do you remember my name?", "Who am I?", "Do you know my name?",
             "What did I say my name was?", "Tell me my name.", "What am I called?", "Remind me of my name.",
             "Say my name.", "what is my name", "Can you tell me my name?", "What's my name again?",
             "Do you still know my name?", "Can you remember my name?", "Which name did I give you?",
             "What name did I tell you?", "What do people call me?", "And my name?", "My name, please?"],
    "city": ["Where do I live?", "Which city do I live in?", "Where am I from?", "What is my city?",
             "Do you remember where I live?", "What city am I from?", "Where did I say I live?",
             "Tell me where I live.", "where do i live", "What's my home town?", "In which city do I live?",
             "Can you remember where I live?", "Which place am I from?", "Where do I come from?",
             "Which city is my home?", "What town am I from?", "Where's home for me?", "And where do I live?"],
    "colour": ["What is my favourite colour?", "What's my favorite color?", "Which colour do I like?",
               "Do you remember my favourite colour?", "What colour do I like best?", "Tell me my favourite colour.",
               "What is my favorite color?", "Can you remember my favourite colour?", "Which colour is my favourite?",
               "What colour did I say I like?", "What's my favourite colour again?", "Name my favourite colour.",
               "Which color do I love?", "And my favourite colour?"],
    "pet": ["What is my {a} called?", "What is the name of my {a}?", "What's my {a}'s name?", "What is my pet's name?",
            "Do you remember my {a}'s name?", "What did I call my {a}?", "What's my pet called?",
            "Can you remember my {a}'s name?", "What name does my {a} have?", "How did I name my {a}?",
            "Which name did I give my {a}?", "My {a} is called what?", "Do you know what my {a} is called?",
            "What was my pet's name?"],
}
HELDOUT_ASK = {
    "name": ["What was my name again?", "Do you recall my name?", "what's my name?", "Remember my name?"],
    "city": ["Which town do I live in?", "Do you know where I live?", "Where is my home?"],
    "colour": ["Which color is my favorite?", "What was my favourite colour?", "Do you know my favourite colour?"],
    "pet": ["How is my {a} called?", "What's the name of my pet?", "Do you know my {a}'s name?"],
}
ASK_REPLY = {
    "name": "Your name is {v}.",
    "city": "You live in {v}.",
    "colour": "Your favourite colour is {v}.",
    "pet": "Your {a} is called {v}.",
}
UNTOLD_REPLY = {
    "name": "I don't know your name: you have not told me.",
    "city": "I don't know where you live: you have not told me.",
    "colour": "I don't know your favourite colour: you have not told me.",
    "pet": "I don't know: you have not told me about a pet.",
}

CALC = ["What is {e}?", "What's {e}?", "Calculate {e}.", "Compute {e}.", "How much is {e}?", "{e} = ?", "{e}?",
        "Please work out {e}.", "Can you calculate {e}?", "what is {e}", "Solve {e}.", "What does {e} make?",
        "{e}", "Quick question: what is {e}?", "Can you work out {e}?", "Find {e}.", "Evaluate {e}.", "I need {e}.",
        "Do {e} for me.", "What is the result of {e}?", "Result of {e}?", "What's {e} equal to?", "{e} is how much?",
        "How much does {e} make?", "Give me {e}.", "{e} makes what?", "What do you get for {e}?",
        "{e} please", "Hey, {e} = ?"]
HELDOUT_CALC = ["What does {e} equal?", "Work out {e}.", "Could you compute {e}?", "Tell me {e}.", "calculate {e}"]
WORD_OPS = {"+": ["plus", "and"], "-": ["minus", "take away"], "*": ["times", "multiplied by"], "/": ["divided by", "over"]}
CALC_ERROR_REPLY = "Sorry, the calculator could not do that."
NO_TOOL_REPLY = "I need my calculate tool for arithmetic: pass chatkit.demo.tools() to the session."
TOOLS = [{"type": "function", "function": {"name": "calculate", "description": "Evaluate an arithmetic expression.",
                                           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                          "required": ["expression"]}}}]

SPELL = ["Spell {w}.", "How do you spell {w}?", "Please spell {w}.", "Can you spell {w}?", "spell {w}"]
REPEAT = ["Repeat after me: {w}.", "Please repeat: {w}.", "Repeat this: {w}.", "Say after me: {w}.", "Say {w}."]
COUNT = ["How many letters are in {w}?", "How many letters does {w} have?", "Count the letters in {w}.",
         "How long is the word {w}?"]

GUIDED = ["Describe me as JSON.", "Fill in my profile.", "What do you know about me?", "Fill in the form.",
          "Extract my details.", "Who am I?", "Summarize what I told you."]
HELDOUT_GUIDED = ["Make my profile.", "Tell me what you know about me.", "Fill in this form about me."]
GUIDED_FIELDS = {"name": ["name", "first_name"], "city": ["city", "home_city"], "colour": ["colour", "color", "favourite_colour"]}
GUIDED_TITLES = ["Person", "Profile", "User", "Contact", "Info", "Me"]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer briefly.",
    "Answer briefly.",
    "Be concise and accurate.",
    "You are a small demo model.",
    "You are a friendly assistant that remembers what the user says.",
    "Keep your answers short.",
    "You are chatkit's demo assistant.",
]

GREETINGS = ["Hello!", "Hi!", "Hi there.", "Hello.", "Good morning!", "Hey!", "hi", "Good evening!"]
THANKS = ["Thank you!", "Thanks.", "Thanks!", "Thank you very much.", "thx", "Great, thanks!"]
BYES = ["Goodbye!", "Bye.", "See you later!", "Bye!", "Good night!"]
WHO = ["Who are you?", "What are you?", "What is your name?", "Are you a robot?"]
CAN = ["What can you do?", "How can you help me?", "Help", "What do you know?"]
OUT = ["What is the capital of {c}?", "Who wrote {w}?", "Tell me about {c}.", "What is the weather in {c}?",
       "Write a poem about {w}.", "Translate {w} into French.", "Who is the president of {c}?",
       "How far is {c} from {d}?", "What time is it?", "Tell me a joke.", "What is the meaning of life?",
       "Can you book a flight to {c}?", "Explain quantum physics.", "What year is it?", "What should I cook today?"]

GREETING_REPLY = "Hello! How can I help you?"
THANKS_REPLY = "You are welcome."
BYE_REPLY = "Goodbye! Have a nice day."
WHO_REPLY = "I am a tiny demo model trained for chatkit."
CAN_REPLY = ("I remember what you tell me about yourself, do arithmetic with my calculate tool, spell and count "
             "letters, repeat after you and fill in a JSON form.")
OUT_REPLY = "Sorry, I don't know about that: I am a tiny demo model."

# Training makes up colours and kinds of pets almost as often as names, so that the model learns to copy
# them too (with made_up_colour 0.3 and made_up_pet 0.15, held-out colours and pets were recalled 19 % and
# 21 % of the time, names 52 %: docs/demo.md, run 7). The held-out world keeps the rates it was first
# measured with, so that every run is scored on the same kind of dialogues.
TRAIN = World(NAMES, CITIES, COLOURS, PETS, TELL, ASK, CALC, GUIDED, made_up=0.6, made_up_colour=0.48, made_up_pet=0.36,
              decimals=0.12, adverbs=("also", "actually", "still", "truly", "honestly", "now", "mostly"))
HELDOUT = World(HELDOUT_NAMES, HELDOUT_CITIES, HELDOUT_COLOURS, HELDOUT_PETS, HELDOUT_TELL, HELDOUT_ASK, HELDOUT_CALC,
                HELDOUT_GUIDED, made_up=0.5, made_up_colour=0.25, made_up_pet=0.125, decimals=0.06)

TASKS = ("arithmetic", "spelling", "counting", "repeat", "tell", "recall", "untold", "smalltalk", "refuse", "guided")


@dataclass
class Turn:
    """A user message and what follows it: assistant messages (the last is the answer) and tool results."""

    user: str
    replies: list[dict]
    task: str
    distance: int | None = None  # recall: turns since the fact was told (1 = the previous turn)
    expression: str | None = None  # arithmetic: the expression the tool call must carry
    schema: dict | None = None  # guided: the JSON Schema the user message describes
    phrasing: str | None = None  # recall and untold: the question's template (before casual variations)

    @property
    def answer(self) -> str:
        return self.replies[-1]["content"]


@dataclass
class Dialogue:
    system: str | None
    tools: bool
    turns: list[Turn] = field(default_factory=list)

    def messages(self, upto: int | None = None) -> list[dict]:
        msgs: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        for t in self.turns[:upto]:
            msgs += [{"role": "user", "content": t.user}, *t.replies]
        return msgs


def say(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


OPENINGS = ["Hey, ", "OK, ", "So, ", "Hmm, ", "Well, ", "By the way, ", "Um, ", "Oh, ", "And ", "Now, ", "Okay so ",
            "Alright, ", "One thing: ", "Listen, "]


def casual(rng: np.random.Generator, text: str) -> str:
    """Small variations users make: an opening word, no final punctuation, a lower-case first letter, '!'."""
    if rng.random() < 0.12:
        first = text if text.startswith(("I ", "I'")) else text[:1].lower() + text[1:]
        text = str(rng.choice(OPENINGS)) + first
    r = rng.random()
    if r < 0.08 and text[-1] in ".?!":
        text = text[:-1]
    elif r < 0.12 and text.endswith("."):
        text = text[:-1] + "!"
    if rng.random() < 0.08 and text[:1].isupper() and not text.startswith(("I ", "I'")):
        text = text[0].lower() + text[1:]
    return text


def operand(rng: np.random.Generator, decimals: float) -> str:
    digits = int(rng.choice([1, 2, 3, 4, 5], p=[0.22, 0.3, 0.22, 0.18, 0.08]))
    n = str(int(rng.integers(10 ** (digits - 1) if digits > 1 else 0, 10**digits)))
    if rng.random() < decimals:
        n += "." + str(int(rng.integers(1, 100)))
    return n


def expression(rng: np.random.Generator, decimals: float) -> tuple[str, list[str]]:
    """An expression in the form tool calls carry ('12 * (3 + 4)') and its tokens."""
    ops = [str(o) for o in rng.choice(["+", "-", "*", "/"], size=int(rng.choice([1, 2, 3], p=[0.78, 0.17, 0.05])),
                                       p=[0.3, 0.27, 0.28, 0.15])]
    parts = [operand(rng, decimals)]
    for op in ops:
        parts += [op, operand(rng, decimals)]
    if len(ops) >= 2 and rng.random() < 0.5:  # parentheses around one operation
        i = 2 * int(rng.integers(len(ops)))
        parts[i] = "(" + parts[i]
        parts[i + 2] = parts[i + 2] + ")"
    return " ".join(parts), parts


def user_expression(rng: np.random.Generator, canonical: str, parts: list[str]) -> str:
    r = rng.random()
    if r < 0.2:
        return canonical.replace(" ", "")
    if r < 0.4 and len(parts) == 3:
        return f"{parts[0]} {rng.choice(WORD_OPS[parts[1]])} {parts[2]}"
    return canonical


def arithmetic(rng: np.random.Generator, world: World, tools: bool) -> Turn:
    from chatkit.demo.calculator import calculate

    if rng.random() < 0.02:
        canonical, parts = f"{operand(rng, world.decimals)} / 0", []
    else:
        canonical, parts = expression(rng, world.decimals)
    user = casual(rng, str(rng.choice(world.calc)).format(e=user_expression(rng, canonical, parts)))
    if not tools:
        return Turn(user, say(NO_TOOL_REPLY), "arithmetic")
    try:
        result, answer = calculate(canonical), None
    except ValueError as exc:  # what chatkit's tool loop sends back when a tool raises
        result, answer = f"Error: calculate raised {type(exc).__name__}: {exc}", CALC_ERROR_REPLY
    call = {"id": "call", "type": "function", "function": {"name": "calculate", "arguments": {"expression": canonical}}}
    replies = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": result, "name": "calculate", "tool_call_id": "call"},
        {"role": "assistant", "content": answer or f"{canonical} = {result}."},
    ]
    return Turn(user, replies, "arithmetic", expression=canonical)


def spelling(rng: np.random.Generator) -> Turn:
    w = str(rng.choice(WORDS))
    return Turn(casual(rng, str(rng.choice(SPELL)).format(w=w)), say(f"The word {w} is spelled {'-'.join(w)}."), "spelling")


def counting(rng: np.random.Generator) -> Turn:
    w = str(rng.choice(WORDS))
    return Turn(casual(rng, str(rng.choice(COUNT)).format(w=w)), say(f"The word {w} has {len(w)} letters."), "counting")


def repeat(rng: np.random.Generator, world: World) -> Turn:
    """Copy a few words back: practice for the copying that recalling facts needs."""
    makers = [lambda: str(rng.choice(WORDS)), lambda: world.name(rng), lambda: world.city(rng), lambda: random_word(rng)]
    words = " ".join(makers[int(rng.integers(4))]() for _ in range(int(rng.integers(1, 6))))
    return Turn(str(rng.choice(REPEAT)).format(w=words), say(f"You said: {words}."), "repeat")


def refuse(rng: np.random.Generator, world: World) -> Turn:
    q = str(rng.choice(OUT)).format(c=world.city(rng), d=world.city(rng), w=str(rng.choice(WORDS)))
    return Turn(casual(rng, q), say(OUT_REPLY), "refuse")


def fact_value(rng: np.random.Generator, world: World, kind: str) -> dict[str, str]:
    if kind == "name":
        return {"v": world.name(rng)}
    if kind == "city":
        return {"v": world.city(rng)}
    if kind == "colour":
        return {"v": world.colour(rng)}
    return {"v": world.name(rng), "a": world.pet(rng)}


def upper_first(text: str) -> str:
    return text[0].upper() + text[1:]


def with_adverb(rng: np.random.Generator, world: World, text: str) -> str:
    """Sometimes an adverb after "I" ("I also live in Oslo."): the fact is not always right after "I"."""
    if world.adverbs and rng.random() < 0.15 and text.startswith("I ") and text.split()[1] in (
            "live", "like", "love", "have", "am", "go", "moved", "grew", "keep", "prefer", "currently"):
        return f"I {rng.choice(world.adverbs)} {text[2:]}"
    return text


def tell(rng: np.random.Generator, world: World, kinds: list[str], values: dict[str, dict[str, str]]) -> tuple[str, str]:
    """The user's message telling one or two facts, and the reply."""
    first = with_adverb(rng, world, str(rng.choice(world.tell[kinds[0]])).format(**values[kinds[0]]))
    if len(kinds) == 1:
        return casual(rng, first), TELL_REPLY[kinds[0]].format(**values[kinds[0]])
    first = str(rng.choice([t for t in world.tell[kinds[0]] if t.endswith("{v}.")])).format(**values[kinds[0]])
    second = str(rng.choice(AND_TELL[kinds[1]])).format(**values[kinds[1]])
    text = f"{first[:-1]}{rng.choice([' and', ', and', ','])} {second}."
    return casual(rng, text), " ".join(TELL_REPLY[k].format(**values[k]) for k in kinds)


@lru_cache(maxsize=None)
def schema_text(fields: tuple[tuple[str, str], ...], title: str, max_length: int | None) -> tuple[str, str]:
    """A pydantic-style JSON Schema with string fields (JSON), and chatkit's description of it."""
    from chatkit.guided.describe import instructions
    from chatkit.guided.spec import output_spec

    props = {}
    for key, _ in fields:
        prop: dict = {"maxLength": max_length} if max_length else {}
        props[key] = {**prop, "title": key.replace("_", " ").title(), "type": "string"}
    schema = {"properties": props, "required": [k for k, _ in fields], "title": title, "type": "object"}
    return json.dumps(schema), instructions(output_spec(schema))


def guided(rng: np.random.Generator, world: World, known: dict[str, dict[str, str]], base: str | None = None,
           told: list[str] | None = None) -> Turn:
    """A question with a JSON Schema appended (as ``respond(..., output=...)`` sends it); the reply is the
    compact JSON object, with the facts known so far and "" for the others. ``base``: the message the
    schema is appended to (a question by default); ``told``: kinds it tells, always among the fields."""
    kinds = [str(k) for k in rng.permutation(list(GUIDED_FIELDS))[: int(rng.integers(1, 4))]]
    if told:
        extra = [k for k in kinds if k not in told][: int(rng.integers(0, 2))]
        kinds = [k for k in GUIDED_FIELDS if k in told or k in extra]
    elif rng.random() < 0.6:
        kinds = ["name", "city"] + [k for k in kinds if k not in ("name", "city")][: int(rng.integers(0, 2))]
    fields = tuple((str(rng.choice(GUIDED_FIELDS[k])), k) for k in kinds)
    value = {key: known[kind]["v"] if kind in known else "" for key, kind in fields}
    longest = max(len(v) for v in value.values())
    max_length = rng.choice([None] + [n for n in (16, 20, 32) if n >= longest])
    schema, described = schema_text(fields, str(rng.choice(GUIDED_TITLES)), max_length)
    base = base or str(rng.choice(world.guided))
    return Turn(f"{base}\n\n{described}", say(json.dumps(value, ensure_ascii=False, separators=(",", ":"))),
                "guided", schema=json.loads(schema))


def turn_count(rng: np.random.Generator) -> int:
    r = rng.random()
    return int(rng.integers(1, 9) if r < 0.55 else rng.integers(9, 17) if r < 0.87 else rng.integers(17, 29))


def make_dialogue(rng: np.random.Generator, world: World = TRAIN, school: bool = False) -> Dialogue:
    """A dialogue of 1-28 turns: facts told and asked back later, questions about facts never told,
    arithmetic through the tool, JSON forms, and other small tasks.

    ``school``: a short dialogue (1-6 turns) that is mostly copying (telling and recalling facts,
    repeating, tool calls): the first steps of training, where copying has to emerge."""
    n = int(rng.integers(1, 7)) if school else turn_count(rng)
    system = str(rng.choice(SYSTEM_PROMPTS)) if rng.random() < 0.4 else None
    tools = rng.random() < (0.95 if school else 0.8)
    plan: list[str] = []
    kinds = [str(k) for k in rng.permutation(list(TELL_REPLY))[: int(rng.integers(1 if school else 0, 5))]]
    cuts = (0.3, 0.65, 0.72) if school else (0.17, 0.42, 0.5)
    for _ in range(n):
        r = rng.random()
        plan.append("tell" if r < cuts[0] else "ask" if r < cuts[1] else "untold" if r < cuts[2] else "other")
    known: dict[str, dict[str, str]] = {}
    turns: list[Turn] = []
    told_at: dict[str, int] = {}
    pending = list(kinds)
    for i, what in enumerate(plan):
        if what == "tell" and pending:
            group = [pending.pop(0)]
            if pending and rng.random() < 0.25:
                group.append(pending.pop(0))
            for k in group:
                known[k] = fact_value(rng, world, k)
                told_at[k] = i
            fields = [k for k in group if k in GUIDED_FIELDS]
            if fields and rng.random() < 0.2:  # "My name is Ada and I live in Oslo." with output=Person
                user, _ = tell(rng, world, group, known)
                turns.append(guided(rng, world, known, base=user, told=fields))
                continue
            user, reply = tell(rng, world, group, known)
            turns.append(Turn(user, say(reply), "tell"))
            continue
        if what == "ask" and known:
            k = str(rng.choice(list(known)))
            phrasing = str(rng.choice(world.ask[k]))
            q = casual(rng, phrasing.format(**known[k]))
            turns.append(Turn(q, say(ASK_REPLY[k].format(**known[k])), "recall", distance=i - told_at[k], phrasing=phrasing))
            continue
        untold = [k for k in TELL_REPLY if k not in known]
        if untold and (what == "untold" or what == "ask" and rng.random() < 0.3):
            k = str(rng.choice(untold))
            phrasing = str(rng.choice(world.ask[k]))
            q = casual(rng, phrasing.format(a=world.pet(rng)))
            turns.append(Turn(q, say(UNTOLD_REPLY[k]), "untold", phrasing=phrasing))
            continue
        r = rng.random()
        if school:
            turns.append(arithmetic(rng, world, tools) if r < 0.55 else repeat(rng, world) if r < 0.9 else guided(rng, world, known))
        elif i == 0 and r < 0.15:
            turns.append(Turn(str(rng.choice(GREETINGS)), say(GREETING_REPLY), "smalltalk"))
        elif i == n - 1 and r < 0.1:
            turns.append(Turn(str(rng.choice(BYES)), say(BYE_REPLY), "smalltalk"))
        elif r < 0.42:
            turns.append(arithmetic(rng, world, tools))
        elif r < 0.5:
            turns.append(spelling(rng))
        elif r < 0.57:
            turns.append(counting(rng))
        elif r < 0.7:
            turns.append(repeat(rng, world))
        elif r < 0.8:  # forms mostly after facts were told: most fields then have a value to copy
            turns.append(guided(rng, world, known) if known or rng.random() < 0.4 else repeat(rng, world))
        elif r < 0.9:
            turns.append(refuse(rng, world))
        elif r < 0.94:
            turns.append(Turn(str(rng.choice(THANKS)), say(THANKS_REPLY), "smalltalk"))
        elif r < 0.97:
            turns.append(Turn(str(rng.choice(WHO)), say(WHO_REPLY), "smalltalk"))
        else:
            turns.append(Turn(str(rng.choice(CAN)), say(CAN_REPLY), "smalltalk"))
    return Dialogue(system, tools, turns)


# --------------------------------------------------------------------------------------------
# Tokenizer and chat template
# --------------------------------------------------------------------------------------------

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED = ("<tool_call>", "</tool_call>")  # plain added tokens, as in Qwen's tokenizers: mlx-lm finds its JSON tool parser
EOS = "<|im_end|>"
PAD = "<|endoftext|>"
def pre_tokenizer_pattern() -> str:
    """The pre-tokenizer's regex: Qwen2's (one digit per token), except that a word which is not a word of
    the demo's own phrases (``phrase_words``: a name, a city, anything the user tells) is split after its
    first letter: " Mipano" -> " M" + "ipano", "Mipano" -> "M" + "ipano". The rest of a value is then the
    same tokens wherever it stands (after a space, at the start of a message, inside a JSON string), and
    its first token is one of a few dozen frequent ones. With Qwen2's regex " Mipano" and "Mipano" have
    other first tokens, and forms and telling replies copied the first token wrong ("Vano" for "Mipano",
    run 9: docs/demo.md)."""
    words = "|".join(sorted(phrase_words(), key=len, reverse=True))
    return (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
            rf"|(?: |(?<!\p{{L}}))(?:{words})(?!\p{{L}})"  # a phrase word, whole, with its leading space
            r"|(?: |(?<!\p{L}))\p{L}(?=\p{L})"  # the first letter of any other word
            r"| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# ChatML with Qwen-style tool calls, made short for a small context: the tools are listed by name in
# the system turn, a call is <tool_call>{"name": ..., "arguments": ...}</tool_call> (mlx-lm's JSON tool
# parser reads it), a result is a message of role "tool".
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}"
    "{{- 'Tools:' }}{%- for tool in tools %}{{- ' ' + (tool.function.name if tool.function is defined else tool.name) }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if (loop.first and message.content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def render(messages: list[dict], tools: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """The text of ``messages`` as CHAT_TEMPLATE renders it (with the demo's tools when ``tools``) and
    the character spans the loss covers: each assistant message with its closing ``<|im_end|>``."""
    parts, spans, pos = [], [], 0
    rest = list(messages)
    if tools or rest and rest[0]["role"] == "system":
        system = rest.pop(0)["content"] if rest and rest[0]["role"] == "system" else None
        lines = ([system] if system else []) + (["Tools: calculate"] if tools else [])
        parts.append(f"<|im_start|>system\n{chr(10).join(lines)}{EOS}\n")
        pos = len(parts[0])
    for m in rest:
        head = f"<|im_start|>{m['role']}\n"
        body = m["content"]
        for i, call in enumerate(m.get("tool_calls") or []):
            f = call["function"]
            sep = "\n" if i or m["content"] else ""
            body += f'{sep}<tool_call>\n{{"name": "{f["name"]}", "arguments": {json.dumps(f["arguments"], ensure_ascii=False)}}}\n</tool_call>'
        body += EOS
        if m["role"] == "assistant":
            spans.append((pos + len(head), pos + len(head) + len(body)))
        piece = head + body + "\n"
        parts.append(piece)
        pos += len(piece)
    return "".join(parts), spans


def tokenizer_texts(seed: int, n: int = 6000) -> list[str]:
    rng = np.random.default_rng([seed, 1])
    texts = [render(d.messages(), d.tools)[0] for d in (make_dialogue(rng) for _ in range(n))]
    # Every word of the world at least a few times, so each becomes one token with its leading space.
    texts += [" ".join(f"{w} {w} {w}" for w in NAMES + CITIES + COLOURS + PETS + WORDS)] * 5
    return texts


def phrase_words() -> list[str]:
    """The words of the demo's own phrases (requests, replies, prompts, chatkit's schema description),
    not the facts users tell (names, cities, colours, pets)."""
    phrases = [TELL, AND_TELL, TELL_REPLY, ASK, ASK_REPLY, UNTOLD_REPLY, CALC, WORD_OPS, SPELL, REPEAT, COUNT, GUIDED,
               GUIDED_FIELDS, GUIDED_TITLES, SYSTEM_PROMPTS, GREETINGS, THANKS, BYES, WHO, CAN, OUT, OPENINGS,
               TRAIN.adverbs, GREETING_REPLY, THANKS_REPLY, BYE_REPLY, WHO_REPLY, CAN_REPLY, OUT_REPLY,
               CALC_ERROR_REPLY, NO_TOOL_REPLY, "The word is spelled has letters. You said: Tools calculate",
               schema_text((("name", "name"), ("city", "city")), "Person", 16)[1]]
    texts: list[str] = []

    def walk(x) -> None:
        if isinstance(x, str):
            texts.append(re.sub(r"\{\w+\}", " ", x))
        elif isinstance(x, dict):
            walk([*x.keys(), *x.values()])
        else:
            for y in x:
                walk(y)

    walk(phrases)
    values = {w for v in NAMES + CITIES + COLOURS + PETS + SHADES for w in v.split()}
    words = dict.fromkeys(w for t in texts for w in re.findall(r"[^\W\d_]+", t))
    return [w for w in words if w not in values]


def train_tokenizer(vocab_size: int, seed: int):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pre_tokenizer_pattern()), behavior="isolated", invert=False),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIALS + ADDED),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text can be written
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_texts(seed), trainer=trainer)
    # Specials and markers must be matched before pre-tokenization (they are ids 0-4 already).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tok


def tokenizer_config(context: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context,
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def encode(tok, dialogues: list[Dialogue]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Token ids and loss masks (1 on the assistant's tokens and their ``<|im_end|>``)."""
    rendered = [render(d.messages(), d.tools) for d in dialogues]
    encs = tok.encode_batch([text for text, _ in rendered], add_special_tokens=False)
    out = []
    for (text, spans), enc in zip(rendered, encs):
        ids = np.array(enc.ids, dtype=np.int32)
        mask = np.zeros(len(ids), dtype=np.float32)
        starts = np.array([s for s, _ in enc.offsets])
        ends = np.array([e for _, e in enc.offsets])
        for a, b in spans:
            mask[(starts >= a) & (ends <= b)] = 1.0
        out.append((ids, mask))
    return out


# --------------------------------------------------------------------------------------------
# Models and training
# --------------------------------------------------------------------------------------------


SHAPES = {
    # name: hidden size, layers, MLP size, attention heads, key-value heads (head_dim 32)
    "chat": (96, 4, 256, 3, 3),
    "draft": (64, 2, 192, 2, 2),
}


def model_config(size: str | tuple[int, ...], vocab_size: int, ids: dict[str, int], context: int) -> dict:
    """mlx-lm's config for a qwen3 model with the context window ``context`` (see ``--context``)."""
    hidden, layers, mlp, heads, kv = SHAPES[size] if isinstance(size, str) else size
    shapes = dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=mlp,
                  num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads)
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        **shapes,
        "vocab_size": vocab_size,
        "max_position_embeddings": context,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
    }


def build_model(config: dict, seed: int):
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    # Small embeddings (they are tied to the output layer), default init elsewhere.
    emb = model.model.embed_tokens
    emb.weight = mx.random.normal(emb.weight.shape) * 0.02
    mx.eval(model.parameters())
    return model


def loss_fn(model, ids, mask):
    logits = model(ids[:, :-1])
    ce = nn.losses.cross_entropy(logits, ids[:, 1:]) * mask[:, 1:]
    return ce.sum() / mask[:, 1:].sum()


def batches(tok, seed: int, batch_size: int, max_len: int, pool: int = 8, school: bool = False):
    """An endless, seeded stream of padded (ids, mask) batches of fresh dialogues.

    Dialogues are drawn ``pool`` batches at a time and sorted by length, so a batch holds dialogues
    of similar lengths and little compute goes to padding; the batches of a pool come in random order.
    """
    rng = np.random.default_rng([seed, 2])
    pad = tok.token_to_id(PAD)
    while True:
        items = [x for x in encode(tok, [make_dialogue(rng, school=school) for _ in range(batch_size * pool)]) if len(x[0]) <= max_len]
        items.sort(key=lambda x: len(x[0]))
        chunks = [items[i : i + batch_size] for i in range(0, len(items), batch_size)]
        for k in rng.permutation(len(chunks)):
            chunk = chunks[k]
            width = -(-max(len(ids) for ids, _ in chunk) // 128) * 128  # few shapes: each compiles once
            ids = np.full((len(chunk), width), pad, dtype=np.int32)
            mask = np.zeros((len(chunk), width), dtype=np.float32)
            for r, (i, m) in enumerate(chunk):
                ids[r, : len(i)] = i
                mask[r, : len(m)] = m
            yield mx.array(ids), mx.array(mask)


def copy_batches(tok, seed: int, batch_size: int = 32, width: int = 128):
    """An endless stream of synthetic copying batches: random token strings, each followed by
    ``<|im_end|>`` and itself again; the loss covers the repeats (from their second token).

    Measured with these phases run by a scratch driver (scripts/logs/demo-training-v2-copy.log; 30 warm-up steps,
    not this script's steps/20): without this phase, 500 to 800 steps of dialogues taught no copying at all (0 %
    recall, held-out names); after 300 steps of it (qwen3 shape 96,4,256,3,3, lr 3e-3, no weight
    decay) the loss on repeats fell from 7.3 to 1.4, and 400 steps of school dialogues then reached
    58-67 % teacher-forced recall of held-out names told 1-2 turns earlier and 48 % exact tool calls.
    (The same run with a llama-shaped model, no q/k norms, learnt no copying in that time.)"""
    rng = np.random.default_rng([seed, 5])
    end, vocab = tok.token_to_id(EOS), tok.get_vocab_size()
    first = len(SPECIALS) + len(ADDED)
    while True:
        ids = np.zeros((batch_size, width), np.int32)
        mask = np.zeros((batch_size, width), np.float32)
        for r in range(batch_size):
            pos = 0
            while True:
                n = int(rng.integers(2, 12))
                if pos + 2 * n + 1 > width:
                    break
                run = rng.integers(first, vocab, size=n)
                ids[r, pos : pos + n] = run
                ids[r, pos + n] = end
                ids[r, pos + n + 1 : pos + 2 * n + 1] = run
                mask[r, pos + n + 2 : pos + 2 * n + 1] = 1.0  # a repeat's first token cannot be known
                pos += 2 * n + 1
        yield mx.array(ids), mx.array(mask)


def train(name: str, model, tok, *, steps: int, batch_size: int, lr: float, seed: int, max_len: int,
          eval_set, copy_steps: int = 0, school_steps: int = 0, weight_decay: float = 0.05,
          log_every: int = 50) -> dict:
    """``copy_steps`` of synthetic copying, then ``school_steps`` of short copying dialogues, then the
    full mix, ``steps`` in all."""
    warmup = max(1, steps // 20)
    schedule = optim.join_schedules(
        [optim.linear_schedule(lr / 100, lr, warmup), optim.cosine_decay(lr, steps - warmup, lr / 20)], [warmup]
    )
    opt = optim.AdamW(learning_rate=schedule, betas=[0.9, 0.98], weight_decay=weight_decay)
    grad = nn.value_and_grad(model, loss_fn)

    def step(ids, mask):
        loss, g = grad(model, ids, mask)
        g, _ = optim.clip_grad_norm(g, 1.0)
        opt.update(model, g)
        return loss

    state = [model.state, opt.state]
    step = mx.compile(step, inputs=state, outputs=state)
    copying = copy_batches(tok, seed)
    school = batches(tok, seed + 1, 2 * batch_size, max_len, school=True)  # short dialogues: twice as many
    stream = batches(tok, seed, batch_size, max_len)
    t0 = time.perf_counter()
    tokens, recent, final = 0, [], {}
    for i in range(1, steps + 1):
        ids, mask = next(copying if i <= copy_steps else school if i <= copy_steps + school_steps else stream)
        loss = step(ids, mask)
        mx.eval(loss, state)
        tokens += ids.size
        recent.append(loss.item())
        if i % log_every == 0 or i == steps:
            dt = time.perf_counter() - t0
            print(f"[{name}] step {i}/{steps} loss {np.mean(recent):.4f} lr {schedule(opt.step).item():.2e} "
                  f"{tokens / dt:.0f} tok/s {dt / 60:.1f} min", flush=True)
            recent = []
        if eval_set is not None and (i % (log_every * 5) == 0 or i == steps):
            report = teacher_forced(model, eval_set)
            final = {"heldout_loss": report.pop("heldout_loss")}  # the last one is the final model's
            print(f"[{name}] held-out exact replies (teacher forced): "
                  + ", ".join(f"{k} {v:.0%}" for k, v in report.items()), flush=True)
    return {"train_loss": float(np.mean(recent or [loss.item()])), "minutes": (time.perf_counter() - t0) / 60, **final}


def make_eval_set(tok, seed: int, n: int = 48):
    """Held-out dialogues (the evaluation's world: names, cities, phrasings training never sees)."""
    rng = np.random.default_rng([seed, 3])
    dialogues = [make_dialogue(rng, HELDOUT) for _ in range(n)]
    return dialogues, encode(tok, dialogues)


def reply_keys(d: Dialogue) -> list[str]:
    """One key per assistant message of ``d``: its turn's task, with tool calls and recall distance apart."""
    keys = []
    for turn in d.turns:
        for m in turn.replies:
            if m["role"] != "assistant":
                continue
            if m.get("tool_calls"):
                keys.append("tool call")
            elif turn.task == "recall":
                keys.append("recall 3+" if turn.distance >= 3 else "recall 1-2")
            else:
                keys.append(turn.task)
    return keys


def teacher_forced(model, eval_set) -> dict:
    """Per task, the share of replies whose every token is the model's argmax (given the true
    context): close to greedy exact-match; and the held-out loss (``heldout_loss``)."""
    dialogues, encoded = eval_set
    hits: dict[str, list[int]] = {}
    total_loss, total_n = 0.0, 0.0
    for d, (ids, mask) in zip(dialogues, encoded):
        x = mx.array(ids)[None]
        logits = model(x[:, :-1])
        ce = nn.losses.cross_entropy(logits, x[:, 1:])[0]
        m = mx.array(mask[1:])
        total_loss += (ce * m).sum().item()
        total_n += float(mask[1:].sum())
        pred = np.array(mx.argmax(logits, axis=-1)[0])
        ok = pred == ids[1:]
        # Mask runs (one per assistant message) in order.
        runs, cur = [], []
        for pos, v in enumerate(mask[1:]):
            if v:
                cur.append(pos)
            elif cur:
                runs.append(cur)
                cur = []
        if cur:
            runs.append(cur)
        for key, run in zip(reply_keys(d), runs, strict=True):
            hits.setdefault(key, []).append(int(ok[run].all()))
    return {**{k: float(np.mean(v)) for k, v in sorted(hits.items())}, "heldout_loss": total_loss / total_n}


def save(folder: Path, model, config: dict, tok) -> None:
    from mlx_lm.utils import save_config, save_model

    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_model(partial, model)
    save_config(dict(config), partial / "config.json")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (partial / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (partial / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    (partial / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(config["max_position_embeddings"]), indent=2) + "\n")
    # Drop files a previous run may have left (e.g. sharded weights) and put the new folder in place.
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


def check_template(tok) -> None:
    """The Python renderer used for training equals the shipped template as transformers renders it
    (with and without tools, tool calls and results, system prompts)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **{k: v for k, v in tokenizer_config(512).items()
                                                           if k not in ("tokenizer_class", "model_max_length")})
    rng = np.random.default_rng(12345)
    for _ in range(40):
        d = make_dialogue(rng)
        msgs = d.messages()
        shipped = hf.apply_chat_template(msgs, tools=TOOLS if d.tools else None, tokenize=False)
        assert shipped == render(msgs, d.tools)[0], (shipped, render(msgs, d.tools)[0])
    ids = tok.encode("<|im_start|>assistant\n<tool_call>", add_special_tokens=False).ids
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.token_to_id("<tool_call>"), ids


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where chat/ and draft/ go (default: the shipped pair)")
    p.add_argument("--vocab-size", type=int, default=1536)
    p.add_argument("--chat-steps", type=int, default=1650)
    p.add_argument("--draft-steps", type=int, default=1400)
    p.add_argument("--copy-steps", type=int, default=300, help="first steps of synthetic copying (see copy_batches)")
    p.add_argument("--school-steps", type=int, default=500, help="then steps of short copying dialogues")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--chat-lr", type=float, default=3e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--max-len", type=int, default=1024, help="longest training dialogue in tokens")
    # A 20-turn chat takes about 950 tokens. Past the window the models would meet positions they were
    # never trained on; written into the configs, it makes chatkit refuse such prompts
    # (ContextWindowExceededError) instead of answering nonsense.
    p.add_argument("--context", type=int, default=1024, help="the context window written into the configs")
    p.add_argument("--chat-shape", default=None, help="hidden,layers,mlp,heads,kv_heads (default %s)" % ",".join(map(str, SHAPES["chat"])))
    p.add_argument("--draft-shape", default=None, help="default %s" % ",".join(map(str, SHAPES["draft"])))
    p.add_argument("--only", choices=["chat", "draft"], default=None,
                   help="train one model in this process (by default both train at once, in two processes)")
    args = p.parse_args(argv)
    for name in ("chat", "draft") if args.only is None else (args.only,):
        if args.copy_steps + args.school_steps >= getattr(args, f"{name}_steps"):
            p.error(f"--copy-steps + --school-steps ({args.copy_steps + args.school_steps}) leave no steps of the "
                    f"full mix in --{name}-steps ({getattr(args, f'{name}_steps')}): give more {name} steps.")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.only is None:
        # Both models at once, one process (one core, one BLAS thread) each; they print their own lines.
        children = [subprocess.Popen([sys.executable, __file__, *argv, "--only", name]) for name in ("chat", "draft")]
        codes = [child.wait() for child in children]
        if any(codes):
            sys.exit(f"training failed (exit codes {codes})")
        print(f"total {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
        return

    name = args.only
    tok = train_tokenizer(args.vocab_size, args.seed)
    check_template(tok)
    if name == "chat":
        pieces = [len(tok.encode(" " + w).ids) for w in HELDOUT_NAMES + HELDOUT_CITIES]
        print(f"tokenizer: {tok.get_vocab_size()} tokens; a held-out name or city is {np.mean(pieces):.1f} tokens "
              f"on average ({time.perf_counter() - t0:.1f} s)", flush=True)
        sample_rng = np.random.default_rng([args.seed, 4])
        sample = encode(tok, [make_dialogue(sample_rng) for _ in range(500)])
        lengths = np.array([len(i) for i, _ in sample])
        masked = sum(m.sum() for _, m in sample) / lengths.sum()
        print(f"dialogues: {lengths.mean():.0f} tokens on average (max {lengths.max()}), "
              f"{masked:.0%} of tokens in the loss", flush=True)
    eval_set = make_eval_set(tok, args.seed + 1000)
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    steps, lr, seed_offset = (args.chat_steps, args.chat_lr, 10) if name == "chat" else (args.draft_steps, args.draft_lr, 20)
    shape = getattr(args, f"{name}_shape")
    config = model_config(tuple(int(x) for x in shape.split(",")) if shape else name, tok.get_vocab_size(), ids, args.context)
    model = build_model(config, args.seed + seed_offset)
    print(f"[{name}] {get_total_parameters(model) / 1e6:.2f}M parameters, {steps} steps of {args.batch_size} dialogues",
          flush=True)
    # Both models see the same batches (same data seed).
    result = train(name, model, tok, steps=steps, batch_size=args.batch_size, lr=lr, seed=args.seed,
                   max_len=args.max_len, eval_set=eval_set, copy_steps=args.copy_steps,
                   school_steps=args.school_steps, weight_decay=args.weight_decay)
    save(args.out / name, model, config, tok)
    size = (args.out / name / "model.safetensors").stat().st_size
    print(f"[{name}] final train loss {result['train_loss']:.4f}, held-out loss {result['heldout_loss']:.4f}, "
          f"{result['minutes']:.1f} min; saved {args.out / name} ({size / 1e6:.1f} MB)", flush=True)


if __name__ == "__main__":
    main()
