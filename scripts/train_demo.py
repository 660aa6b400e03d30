"""Train chatkit's bundled demo pair: a small chat model and a much smaller draft model.

Everything is synthetic and reproducible from ``--seed``:

1. multi-turn dialogues (small sums, spelling, letter counts, facts the user tells and asks back
   several turns later, repeating a few words, small talk), with a system prompt in about half of them;
2. a byte-level BPE tokenizer (``tokenizers``) with ChatML specials and single-digit numbers;
3. two qwen3-architecture models (mlx-lm's own classes) trained with MLX on the same batches, loss on
   the assistant's tokens only (its reply and the closing ``<|im_end|>``);
4. both saved as folders ``mlx_lm.load`` / ``chatkit.load`` read, into ``chatkit/demo/models/``.

Run (about 19 minutes on 2 x86 cores, float32 with OpenBLAS: 13.6 for the chat model, 5.5 for the draft)::

    python scripts/train_demo.py            # writes chatkit/demo/models/{chat,draft}
    python scripts/train_demo.py --quick    # a short smoke run into /tmp/chatkit-demo-quick

``scripts/eval_demo.py`` plays held-out dialogues (``make_dialogue`` with another seed) through
``chatkit.ChatSession``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import chatkit  # noqa: F401  (loads OpenBLAS before MLX: float32 training is ~10x faster)

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_lm.utils import get_total_parameters

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "chatkit" / "demo" / "models"

# --------------------------------------------------------------------------------------------
# The synthetic world
# --------------------------------------------------------------------------------------------

NAMES = """Ada Alan Grace Linus Marie Nina Omar Priya Yuki Leo Sara Tom Emma Noah Olivia Liam Mia Lucas
Zoe Ivan Elena Hugo Ines Kai Lena Max Nora Oscar Paula Quinn Rosa Sam Tara Uma Victor Wendy Xavier
Yara Zack Aiko Bruno Chloe Diego Eva Felix Gina Hana Igor Jade Karl Lara Mateo Nadia Otto Pia Raul
Theo Vera Will Yusuf Zara Amir Bea Carlos Dara Erik Fatima Gus Hiro Isla Jonas Kira Luca Maya Nils
Olga Pedro Rita Sven Tina Ugo Wanda Yves Anna Ben Clara Dan Ella Finn Greta Hans Iris Jack Kate Leon
Mona Nick Pablo Ruth Simon Tess Vince Amelia Boris Cyrus Dora Edgar Flora Gabriel Helga Irene
Jasper Keiko Lorenzo Mirela Nikolai Ophelia Rafael Selma Tobias Valentina Wilhelm Zainab""".split()

CITIES = """Lyon Paris Berlin Tokyo Lima Oslo Rome Cairo Delhi Seoul Madrid Lisbon Vienna Prague Dublin
Boston Denver Austin Toronto Sydney Nairobi Lagos Hanoi Bangkok Manila Quito Bogota Havana Athens
Warsaw Helsinki Zurich Geneva Munich Hamburg Milan Naples Porto Seville Valencia Montreal Chicago
Seattle Portland Kyoto Osaka Busan Mumbai Dhaka Riga Tallinn Vilnius Bern Ghent Leeds York Glasgow
Krakow Marseille Bordeaux Nantes Turin Florence Stockholm Copenhagen Reykjavik Santiago""".split()

COLOURS = """red blue green yellow orange purple pink brown black white grey gold silver teal violet
indigo cyan beige maroon navy""".split()

PETS = "dog cat rabbit parrot hamster turtle horse goldfish".split()
PET_NAMES = """Rex Bella Milo Luna Coco Buddy Daisy Rocky Pepper Oreo Biscuit Shadow Ziggy Mango Peanut
Toby Whiskers Nemo Simba Kiwi Ginger Bailey Charlie Pickles Noodle Pip Fudge Sunny Olive Bruno""".split()

WORDS = """cat dog sun moon tree book fish bird apple lemon house water river cloud chair table bread
milk cake rain snow wind fire stone grass leaf road ship boat train plane car bike door window
garden flower horse mouse tiger lion zebra panda koala eagle shark whale frog snake bee ant owl
bear wolf fox duck goat sheep cow pig hat shoe sock coat ring key lamp clock phone paper pencil
music song dance dream smile heart hand foot head nose mouth eye ear hair night day summer winter
spring autumn morning island forest desert ocean beach hill valley bridge castle tower city town
king queen robot rocket planet star sugar salt honey butter cheese pizza pasta rice soup tea
coffee juice orange banana grape melon peach cherry plum pear olive carrot potato tomato onion""".split()

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

GREETINGS = ["Hello!", "Hi!", "Hi there.", "Hello.", "Good morning!", "Hey!"]
THANKS = ["Thank you!", "Thanks.", "Thanks!", "Thank you very much."]
BYES = ["Goodbye!", "Bye.", "See you later!", "Bye!"]
WHO = ["Who are you?", "What are you?"]
CAN = ["What can you do?", "How can you help me?"]

GREETING_REPLY = "Hello! How can I help you?"
THANKS_REPLY = "You are welcome."
BYE_REPLY = "Goodbye! Have a nice day."
WHO_REPLY = "I am a tiny demo model trained for chatkit."
CAN_REPLY = "I can do small sums, spell words, count letters, repeat after you and remember what you tell me."

# The facts a user can tell, how they are told and asked, and the replies.
FACTS = ("name", "city", "colour", "pet", "age")
TELL = {
    "name": ["My name is {v}.", "I am called {v}.", "Call me {v}.", "Hi, I'm {v}."],
    "city": ["I live in {v}.", "I am from {v}.", "My home town is {v}."],
    "colour": ["My favourite colour is {v}.", "I like the colour {v}.", "My favourite color is {v}."],
    "pet": ["My {a} is called {v}.", "I have a {a} named {v}.", "My {a}'s name is {v}."],
    "age": ["I am {v} years old.", "I'm {v} years old.", "My age is {v}."],
}
TELL_REPLY = {
    "name": "Nice to meet you, {v}.",
    "city": "Noted: you live in {v}.",
    "colour": "Noted: your favourite colour is {v}.",
    "pet": "Noted: your {a} is called {v}.",
    "age": "Noted: you are {v} years old.",
}
ASK = {
    "name": ["What is my name?", "What's my name?", "Do you remember my name?", "Who am I?"],
    "city": ["Where do I live?", "Which city do I live in?", "Where am I from?"],
    "colour": ["What is my favourite colour?", "Which colour do I like?", "What's my favourite color?"],
    "pet": ["What is my {a} called?", "What is the name of my {a}?", "What's my {a}'s name?"],
    "age": ["How old am I?", "What is my age?", "Do you remember how old I am?"],
}
ASK_REPLY = {
    "name": "Your name is {v}.",
    "city": "You live in {v}.",
    "colour": "Your favourite colour is {v}.",
    "pet": "Your {a} is called {v}.",
    "age": "You are {v} years old.",
}
UNTOLD_REPLY = {
    "name": "You have not told me your name yet.",
    "city": "You have not told me where you live yet.",
    "colour": "You have not told me your favourite colour yet.",
    "age": "You have not told me your age yet.",
}

ADD = ["What is {a} + {b}?", "What is {a} plus {b}?", "Calculate {a} + {b}.", "What's {a} + {b}?", "{a} + {b} = ?"]
SUB = ["What is {a} - {b}?", "What is {a} minus {b}?", "Calculate {a} - {b}.", "What's {a} - {b}?", "{a} - {b} = ?"]
MUL = ["What is {a} * {b}?", "What is {a} times {b}?", "Calculate {a} * {b}.", "What's {a} * {b}?", "{a} * {b} = ?"]
SPELL = ["Spell {w}.", "How do you spell {w}?", "Please spell {w}.", "Can you spell {w}?"]
REPEAT = ["Repeat after me: {w}.", "Please repeat: {w}.", "Repeat this: {w}.", "Say after me: {w}."]
COUNT = ["How many letters are in {w}?", "How many letters does {w} have?", "Count the letters in {w}."]

TASKS = ("arithmetic", "spelling", "counting", "repeat", "tell", "recall", "untold", "smalltalk")


@dataclass
class Turn:
    user: str
    reply: str
    task: str
    distance: int | None = None  # recall: turns since the fact was told (1 = the previous turn)


@dataclass
class Dialogue:
    system: str | None
    turns: list[Turn] = field(default_factory=list)

    def messages(self, upto: int | None = None) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for t in self.turns[:upto]:
            msgs += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.reply}]
        return msgs


def arithmetic(rng: np.random.Generator) -> Turn:
    op = rng.choice(3, p=[0.45, 0.35, 0.2])
    if op == 0:
        a, b = (int(x) for x in rng.integers(0, 13, 2))
        q, r = ADD, f"{a} + {b} = {a + b}."
    elif op == 1:
        a, b = sorted((int(x) for x in rng.integers(0, 16, 2)), reverse=True)
        q, r = SUB, f"{a} - {b} = {a - b}."
    else:
        a, b = (int(x) for x in rng.integers(1, 10, 2))
        q, r = MUL, f"{a} * {b} = {a * b}."
    return Turn(str(rng.choice(q)).format(a=a, b=b), r, "arithmetic")


def spelling(rng: np.random.Generator) -> Turn:
    w = str(rng.choice(WORDS))
    return Turn(str(rng.choice(SPELL)).format(w=w), f"The word {w} is spelled {'-'.join(w)}.", "spelling")


def counting(rng: np.random.Generator) -> Turn:
    w = str(rng.choice(WORDS))
    return Turn(str(rng.choice(COUNT)).format(w=w), f"The word {w} has {len(w)} letters.", "counting")


def repeat(rng: np.random.Generator) -> Turn:
    """Copy a few words back: easy practice for the copying that recalling facts needs."""
    pool = WORDS + NAMES + CITIES + COLOURS
    words = " ".join(str(w) for w in rng.choice(pool, size=int(rng.integers(2, 7))))
    return Turn(str(rng.choice(REPEAT)).format(w=words), f"You said: {words}.", "repeat")


def fact_value(rng: np.random.Generator, kind: str) -> dict[str, str]:
    if kind == "name":
        return {"v": str(rng.choice(NAMES))}
    if kind == "city":
        return {"v": str(rng.choice(CITIES))}
    if kind == "colour":
        return {"v": str(rng.choice(COLOURS))}
    if kind == "pet":
        return {"v": str(rng.choice(PET_NAMES)), "a": str(rng.choice(PETS))}
    return {"v": str(int(rng.integers(5, 100)))}


def make_dialogue(rng: np.random.Generator) -> Dialogue:
    """A dialogue of 4-14 turns: facts told and asked back later, among other questions."""
    n = int(rng.integers(4, 15))
    system = str(rng.choice(SYSTEM_PROMPTS)) if rng.random() < 0.5 else None
    slots: list[Turn | None] = [None] * n
    # Facts: each told once, then asked back 1-2 times, 1 to n-1 turns later.
    kinds = list(rng.permutation(FACTS))[: int(rng.integers(0 if rng.random() < 0.1 else 1, min(4, n // 2) + 1))]
    free = list(range(n))
    for kind in kinds:
        told_candidates = [i for i in free if i < n - 1 and any(j > i for j in free)]
        if not told_candidates:
            break
        i = int(rng.choice(told_candidates))
        later = [j for j in free if j > i]
        asks = sorted(rng.choice(later, size=min(len(later), int(rng.integers(1, 4))), replace=False).tolist())
        fv = fact_value(rng, kind)
        slots[i] = Turn(str(rng.choice(TELL[kind])).format(**fv), TELL_REPLY[kind].format(**fv), "tell")
        for j in asks:
            slots[j] = Turn(
                str(rng.choice(ASK[kind])).format(**fv), ASK_REPLY[kind].format(**fv), "recall", distance=j - i
            )
        free = [k for k in free if k != i and k not in asks]
    # Sometimes a question about a fact that was never told.
    untold = [k for k in UNTOLD_REPLY if k not in kinds]
    if untold and free and rng.random() < 0.25:
        kind = str(rng.choice(untold))
        j = int(rng.choice(free))
        slots[j] = Turn(str(rng.choice(ASK[kind])), UNTOLD_REPLY[kind], "untold")
        free.remove(j)
    for j in free:
        if j == 0 and rng.random() < 0.3:
            slots[j] = Turn(str(rng.choice(GREETINGS)), GREETING_REPLY, "smalltalk")
            continue
        if j == n - 1 and rng.random() < 0.2:
            slots[j] = Turn(str(rng.choice(BYES)), BYE_REPLY, "smalltalk")
            continue
        r = rng.random()
        if r < 0.45:
            slots[j] = arithmetic(rng)
        elif r < 0.60:
            slots[j] = spelling(rng)
        elif r < 0.75:
            slots[j] = counting(rng)
        elif r < 0.94:
            slots[j] = repeat(rng)
        elif r < 0.97:
            slots[j] = Turn(str(rng.choice(THANKS)), THANKS_REPLY, "smalltalk")
        elif r < 0.985:
            slots[j] = Turn(str(rng.choice(WHO)), WHO_REPLY, "smalltalk")
        else:
            slots[j] = Turn(str(rng.choice(CAN)), CAN_REPLY, "smalltalk")
    return Dialogue(system, [t for t in slots if t is not None])


# --------------------------------------------------------------------------------------------
# Tokenizer and chat template
# --------------------------------------------------------------------------------------------

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS = "<|im_end|>"
PAD = "<|endoftext|>"
# Qwen2's pre-tokenizer regex: words with their leading space, one digit per token.
PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def render(messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The ChatML text of ``messages`` (as CHAT_TEMPLATE renders it) and the character spans the loss
    covers: each assistant reply with its closing ``<|im_end|>``."""
    parts, spans, pos = [], [], 0
    for m in messages:
        head = f"<|im_start|>{m['role']}\n"
        body = m["content"] + EOS
        if m["role"] == "assistant":
            spans.append((pos + len(head), pos + len(head) + len(body)))
        piece = head + body + "\n"
        parts.append(piece)
        pos += len(piece)
    return "".join(parts), spans


def train_tokenizer(vocab_size: int, seed: int):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    rng = np.random.default_rng([seed, 1])
    texts = [render(make_dialogue(rng).messages())[0] for _ in range(20000)]
    # Every word of the world at least a few times, so each becomes one token with its leading space.
    texts += [" ".join(f"{w} {w} {w}" for w in NAMES + CITIES + COLOURS + PETS + PET_NAMES + WORDS)] * 5
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Specials must be matched before pre-tokenization (they are ids 0-2 already).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
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
    """Token ids and loss masks (1 on the assistant's reply tokens and their ``<|im_end|>``)."""
    rendered = [render(d.messages()) for d in dialogues]
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
    "chat": (64, 4, 256, 2, 1),
    "draft": (32, 2, 128, 1, 1),
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


def batches(tok, seed: int, batch_size: int, max_len: int, pool: int = 8):
    """An endless, seeded stream of padded (ids, mask) batches of fresh dialogues.

    Dialogues are drawn ``pool`` batches at a time and sorted by length, so a batch holds dialogues
    of similar lengths and little compute goes to padding; the batches of a pool come in random order.
    """
    rng = np.random.default_rng([seed, 2])
    pad = tok.token_to_id(PAD)
    while True:
        items = [x for x in encode(tok, [make_dialogue(rng) for _ in range(batch_size * pool)]) if len(x[0]) <= max_len]
        items.sort(key=lambda x: len(x[0]))
        chunks = [items[i : i + batch_size] for i in range(0, len(items), batch_size)]
        for k in rng.permutation(len(chunks)):
            chunk = chunks[k]
            width = -(-max(len(ids) for ids, _ in chunk) // 32) * 32
            ids = np.full((len(chunk), width), pad, dtype=np.int32)
            mask = np.zeros((len(chunk), width), dtype=np.float32)
            for r, (i, m) in enumerate(chunk):
                ids[r, : len(i)] = i
                mask[r, : len(m)] = m
            yield mx.array(ids), mx.array(mask)


def loss_fn(model, ids, mask):
    logits = model(ids[:, :-1])
    ce = nn.losses.cross_entropy(logits, ids[:, 1:]) * mask[:, 1:]
    return ce.sum() / mask[:, 1:].sum()


def train(name: str, model, tok, *, steps: int, batch_size: int, lr: float, seed: int, max_len: int,
          eval_set, log_every: int = 50) -> dict:
    warmup = max(1, steps // 20)
    schedule = optim.join_schedules(
        [optim.linear_schedule(lr / 100, lr, warmup), optim.cosine_decay(lr, steps - warmup, lr / 20)], [warmup]
    )
    opt = optim.AdamW(learning_rate=schedule, betas=[0.9, 0.98], weight_decay=0.05)
    grad = nn.value_and_grad(model, loss_fn)

    def step(ids, mask):
        loss, g = grad(model, ids, mask)
        g, _ = optim.clip_grad_norm(g, 1.0)
        opt.update(model, g)
        return loss

    state = [model.state, opt.state]
    step = mx.compile(step, inputs=state, outputs=state)
    stream = batches(tok, seed, batch_size, max_len)
    t0 = time.perf_counter()
    tokens, recent = 0, []
    for i in range(1, steps + 1):
        ids, mask = next(stream)
        loss = step(ids, mask)
        mx.eval(loss, state)
        tokens += ids.size
        recent.append(loss.item())
        if i % log_every == 0 or i == steps:
            dt = time.perf_counter() - t0
            print(f"[{name}] step {i}/{steps} loss {np.mean(recent):.4f} lr {schedule(opt.step).item():.2e} "
                  f"{tokens / dt:.0f} tok/s {dt / 60:.1f} min", flush=True)
            recent = []
        if eval_set is not None and (i % (log_every * 10) == 0 or i == steps):
            report = teacher_forced(model, eval_set)
            print(f"[{name}] held-out exact replies (teacher forced): "
                  + ", ".join(f"{k} {v:.0%}" for k, v in report.items()), flush=True)
    final = teacher_forced(model, eval_set, loss_only=True) if eval_set is not None else {}
    return {"train_loss": float(np.mean(recent or [loss.item()])), "minutes": (time.perf_counter() - t0) / 60, **final}


def make_eval_set(tok, seed: int, n: int = 96):
    rng = np.random.default_rng([seed, 3])
    dialogues = [make_dialogue(rng) for _ in range(n)]
    return dialogues, encode(tok, dialogues)


def teacher_forced(model, eval_set, loss_only: bool = False) -> dict:
    """Per task, the share of replies whose every token is the model's argmax (given the true
    context): close to greedy exact-match. Or, with ``loss_only``, the held-out loss."""
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
        if loss_only:
            continue
        pred = np.array(mx.argmax(logits, axis=-1)[0])
        ok = pred == ids[1:]
        # Mask runs (one per reply) in order.
        runs, cur = [], []
        for pos, v in enumerate(mask[1:]):
            if v:
                cur.append(pos)
            elif cur:
                runs.append(cur)
                cur = []
        if cur:
            runs.append(cur)
        for turn, run in zip(d.turns, runs):
            key = turn.task if turn.task != "recall" else ("recall 3+" if turn.distance >= 3 else "recall 1-2")
            hits.setdefault(key, []).append(int(ok[run].all()))
    if loss_only:
        return {"heldout_loss": total_loss / total_n}
    return {k: float(np.mean(v)) for k, v in sorted(hits.items())}


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
    """The Python renderer used for training equals the jinja template the models ship with."""
    import jinja2

    env = jinja2.Environment()
    template = env.from_string(CHAT_TEMPLATE)
    rng = np.random.default_rng(12345)
    for _ in range(20):
        msgs = make_dialogue(rng).messages()
        assert template.render(messages=msgs, add_generation_prompt=False) == render(msgs)[0]
    ids = tok.encode("<|im_start|>assistant\n", add_special_tokens=False).ids
    assert ids[0] == tok.token_to_id("<|im_start|>"), ids


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT} (/tmp/chatkit-demo-quick with --quick)")
    p.add_argument("--vocab-size", type=int, default=1536)
    p.add_argument("--chat-steps", type=int, default=None, help="default 3000 (150 with --quick)")
    p.add_argument("--draft-steps", type=int, default=None, help="default 2200 (150 with --quick)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--chat-lr", type=float, default=3e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--max-len", type=int, default=512, help="longest training dialogue in tokens")
    # The training dialogues are at most ~400 tokens long; past ~450 the models meet positions they
    # were never trained on and their answers fall apart. Written into the configs as the context
    # window, it makes chatkit refuse such prompts (ContextWindowExceededError) instead.
    p.add_argument("--context", type=int, default=448, help="the context window written into the configs")
    p.add_argument("--chat-shape", default=None, help="hidden,layers,mlp,heads,kv_heads (default %s)" % ",".join(map(str, SHAPES["chat"])))
    p.add_argument("--draft-shape", default=None, help="default %s" % ",".join(map(str, SHAPES["draft"])))
    p.add_argument("--quick", action="store_true", help="a short smoke run (a few minutes)")
    p.add_argument("--only", choices=["chat", "draft"], default=None, help="train one model only")
    args = p.parse_args(argv)
    args.chat_steps = args.chat_steps or (150 if args.quick else 3000)
    args.draft_steps = args.draft_steps or (150 if args.quick else 2200)
    out = args.out or (Path("/tmp/chatkit-demo-quick") if args.quick else DEFAULT_OUT)

    t0 = time.perf_counter()
    tok = train_tokenizer(args.vocab_size, args.seed)
    check_template(tok)
    vocab = tok.get_vocab()
    single = [w for w in NAMES + CITIES + COLOURS + PET_NAMES + WORDS if f"\u0120{w}" in vocab]
    print(f"tokenizer: {tok.get_vocab_size()} tokens, {len(single)}/"
          f"{len(NAMES + CITIES + COLOURS + PET_NAMES + WORDS)} world words are one token "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    sample_rng = np.random.default_rng([args.seed, 4])
    sample = encode(tok, [make_dialogue(sample_rng) for _ in range(500)])
    lengths = np.array([len(i) for i, _ in sample])
    masked = sum(m.sum() for _, m in sample) / lengths.sum()
    print(f"dialogues: {lengths.mean():.0f} tokens on average (max {lengths.max()}), "
          f"{masked:.0%} of tokens in the loss", flush=True)

    eval_set = make_eval_set(tok, args.seed + 1000)
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    results = {}
    for name, steps, lr, seed_offset in (("chat", args.chat_steps, args.chat_lr, 10), ("draft", args.draft_steps, args.draft_lr, 20)):
        if args.only and name != args.only:
            continue
        shape = getattr(args, f"{name}_shape")
        config = model_config(tuple(int(x) for x in shape.split(",")) if shape else name, tok.get_vocab_size(), ids,
                              args.context)
        model = build_model(config, args.seed + seed_offset)
        n_params = get_total_parameters(model)
        print(f"[{name}] {n_params / 1e6:.2f}M parameters, {steps} steps of {args.batch_size} dialogues", flush=True)
        # Both models see the same batches (same data seed).
        results[name] = train(name, model, tok, steps=steps, batch_size=args.batch_size, lr=lr,
                              seed=args.seed, max_len=args.max_len, eval_set=eval_set)
        save(out / name, model, config, tok)
        size = (out / name / "model.safetensors").stat().st_size
        print(f"[{name}] final train loss {results[name]['train_loss']:.4f}, held-out loss "
              f"{results[name]['heldout_loss']:.4f}, {results[name]['minutes']:.1f} min; "
              f"saved {out / name} ({size / 1e6:.1f} MB)", flush=True)
    print(f"total {(time.perf_counter() - t0) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
