"""The tokenizer a GGUF file describes, as ``tokenizer.json`` + ``tokenizer_config.json``.

transformers' GGUF tokenizer conversion does the work (it needs no torch); this module gives it the
metadata ``mx.load`` read, adds the pre-tokenizers it does not know, and refuses vocabularies it
would only guess at.
"""

from __future__ import annotations

from typing import Any

from .reader import value


class TokenizerUnavailable(Exception):
    """The file's own tokenizer cannot be built faithfully; the message says why."""


# Pre-tokenizers transformers' table lacks (llama.cpp's names), built like the models' own tokenizer.json.
def _extra_pre_tokenizer(name: str | None):
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "smollm":  # SmolLM / SmolLM2: digits one by one, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name in (None, "default", "gpt-2", "gpt2"):
        return byte_level
    return None


def build(meta: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(tokenizers.Tokenizer, tokenizer_config dict)`` from GGUF metadata.

    Raises ``TokenizerUnavailable`` when the file lacks what a faithful tokenizer needs.
    """
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_PRE_TOKENIZER_SPLITS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    d = {
        name: value(meta, f"tokenizer.{key}")
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }
    kind, pre = d.get("tokenizer_type"), d.get("pre_tokenizer_type")
    _check_vocabulary(d, known_splits=GGUF_PRE_TOKENIZER_SPLITS)
    arch = value(meta, "general.architecture")
    try:
        tokenizer, _ = convert_gguf_tokenizer(arch, d)
    except Exception as exc:  # transformers raises ValueError/KeyError on files it cannot read
        raise TokenizerUnavailable(f"transformers could not convert it: {exc}") from exc
    if kind == "gpt2" and pre not in GGUF_PRE_TOKENIZER_SPLITS:
        tokenizer.pre_tokenizer = _extra_pre_tokenizer(pre)
    return tokenizer, _tokenizer_config(meta, d["tokens"], kind)


def _check_vocabulary(d: dict[str, Any], known_splits: Any) -> None:
    """``TokenizerUnavailable`` unless the vocabulary ``d`` (transformers' names for the GGUF keys) can
    be rebuilt faithfully; ``known_splits``: the pre-tokenizers transformers knows."""
    kind, pre = d.get("tokenizer_type"), d.get("pre_tokenizer_type")
    if not d.get("tokens"):
        raise TokenizerUnavailable("the file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    if kind == "gpt2":
        if "merges" not in d:
            raise TokenizerUnavailable("its byte-level BPE vocabulary comes without merges")
        extra = _extra_pre_tokenizer(pre)
        if pre not in known_splits and extra is None:
            raise TokenizerUnavailable(f"its pre-tokenizer {pre!r} is not one chatkit knows how to rebuild")
    elif kind == "llama":
        scores = d.get("scores") or []
        if "merges" not in d and len(set(scores)) <= 1:
            # mlx-lm's GGUF writer stores a BPE vocabulary this way: no merges, every score -1000.
            raise TokenizerUnavailable("its SentencePiece vocabulary has neither merges nor scores to order merges by")
    else:
        raise TokenizerUnavailable(f"its tokenizer model {kind!r} is not supported (gpt2 and llama are)")


def _tokenizer_config(meta: dict[str, Any], tokens: list[str], kind: str | None) -> dict[str, Any]:
    """The ``tokenizer_config.json`` of the file's tokenizer: special tokens, flags, chat template."""

    def token(key: str) -> str | None:
        i = value(meta, f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    config: dict[str, Any] = {
        # PreTrainedTokenizerFast: transformers 5 would rebuild the pre-tokenizer for a named class.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(value(meta, "tokenizer.ggml.add_bos_token", kind == "llama")),
        "add_eos_token": bool(value(meta, "tokenizer.ggml.add_eos_token", False)),
    }
    if template := value(meta, "tokenizer.chat_template"):
        config["chat_template"] = template
    return {k: v for k, v in config.items() if v is not None}


def eos_token_ids(meta: dict[str, Any]) -> list[int]:
    """Every id the file marks as ending a reply (end of sequence, of turn, of message)."""
    ids = [value(meta, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


__all__ = ["TokenizerUnavailable", "build", "eos_token_ids"]
