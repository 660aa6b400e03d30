"""Vision-language models through mlx-vlm (the ``vision`` extra, imported lazily).

``load()`` sends a folder whose config has a ``vision_config`` here. The result is a ``LoadedModel`` whose
``model`` is the language model alone, called as mlx-lm calls a model (``model(ids, cache=...,
input_embeddings=...)`` returns logits), so sessions prefill, decode and keep their KV cache exactly as for
text; its ``vision`` is a :class:`Vision`: the mlx-vlm model, its processor, and what turns images into the
embeddings of their tokens (:class:`ImageEncoder`, one per session, encodes each image once).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import CacheError, InvalidMessageError, MissingDependencyError, ModelLoadError
from ..images import Image, ImageSpan

MAX_IMAGES = 16  # images in one prompt, by default


def is_vision_config(config: Mapping[str, Any]) -> bool:
    """Whether a model config describes a vision-language model (it has a vision tower's config)."""
    return isinstance(config.get("vision_config"), Mapping)


class TextModel(nn.Module):
    """An mlx-vlm model's language model, called as mlx-lm calls a model; ``positions`` (set per call by
    :class:`Positions`) gives multimodal RoPE position ids (Qwen2-VL's M-RoPE) for ``(offset, length)``."""

    def __init__(self, vlm: nn.Module) -> None:
        super().__init__()
        self.language_model = vlm.language_model
        self.args = getattr(self.language_model, "args", None) or getattr(self.language_model, "config", None)

    @property
    def layers(self) -> Any:
        return self.language_model.layers

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None,
                 positions: Positions | None = None) -> mx.array:
        kwargs: dict[str, Any] = {}
        if positions is not None:
            offset = int(cache[0].offset) if cache else 0
            kwargs["position_ids"] = positions.at(offset, inputs.shape[1])
        out = self.language_model(inputs, inputs_embeds=input_embeddings, cache=cache, **kwargs)
        return out.logits if hasattr(out, "logits") else out


class Bound(nn.Module):
    """``TextModel`` with one prompt's positions: what a turn's token source calls."""

    def __init__(self, text: TextModel, positions: Positions | None) -> None:
        super().__init__()
        self.text = text
        self._positions = positions

    @property
    def layers(self) -> Any:
        return self.text.layers

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None) -> mx.array:
        return self.text(inputs, cache=cache, input_embeddings=input_embeddings, positions=self._positions)


@dataclass(frozen=True)
class Positions:
    """M-RoPE position ids (3 x 1 x N) of a prompt's tokens from ``start`` on (``ids``; ``None`` when they are
    all text), and ``delta``: a text token's position minus its index after them."""

    ids: mx.array | None
    delta: int
    start: int = 0

    def at(self, offset: int, length: int) -> mx.array:
        """The position ids of the ``length`` tokens from index ``offset`` (``>= start``)."""
        assert offset >= self.start, "positions before start are not known"
        lo, n = offset - self.start, 0 if self.ids is None else self.ids.shape[-1]
        if self.ids is not None and lo + length <= n:
            return self.ids[:, :, lo : lo + length]
        dtype = mx.int32 if self.ids is None else self.ids.dtype
        tail = mx.arange(self.start + max(lo, n) + self.delta, offset + length + self.delta, dtype=dtype)
        tail = mx.broadcast_to(tail[None, None], (3, 1, tail.shape[0]))
        return tail if self.ids is None or lo >= n else mx.concatenate([self.ids[:, :, lo:n], tail], axis=-1)


@dataclass(frozen=True)
class VisionInput:
    """What a vision prompt's turn feeds after the cached tokens: the input ``embeddings`` of the rest of
    the prompt (its images' features in place), through ``model``, the language model bound to the
    prompt's positions (called in place of the token source's model)."""

    embeddings: mx.array
    model: Bound


@dataclass(frozen=True)
class Encoded:
    """One image as a model sees it: its placeholder ``ids`` and their embeddings (``features``),
    and the processor's extra outputs (e.g. ``image_grid_thw``)."""

    ids: tuple[int, ...]
    features: mx.array | None  # None: known from a restored cache only (its pixels were not saved)
    extra: Mapping[str, Any]

    @property
    def layout(self) -> tuple[int, ...]:
        """The processor's patch grid of the image, for models whose positions use it (else empty)."""
        grid = self.extra.get("image_grid_thw")
        return () if grid is None else tuple(_ints(grid))


class Vision:
    """The vision side of a loaded vision-language model: the mlx-vlm model and its processor."""

    def __init__(self, vlm: nn.Module, processor: Any) -> None:
        self.vlm = vlm
        self.processor = processor
        self.text = TextModel(vlm)
        self.image_token: str = processor.image_token
        self.image_token_id = int(_token_id(processor, self.image_token))
        self.mrope = hasattr(self.text.language_model, "get_rope_index")
        self.max_images = MAX_IMAGES
        # Gemma 3's scheme: the template writes a marker (<start_of_image>) per image, and the processor puts
        # a text in its place (newlines and boundary tokens around the image tokens) before tokenizing.
        sequence = getattr(processor, "full_image_sequence", None)
        marker = getattr(processor, "boi_token", None)
        self.expansion = (marker, sequence) if isinstance(sequence, str) and isinstance(marker, str) else None
        language = self.text.language_model
        if hasattr(language, "make_cache"):  # e.g. Gemma 3's sliding-window layers
            _lm_caches(language.make_cache())  # ModelLoadError now, for layers chatkit cannot keep
            self.text.make_cache = lambda: _lm_caches(language.make_cache())
        self._masked = "mask" in inspect.signature(vlm.get_input_embeddings).parameters

    def rewrite(self, text: str) -> str:
        """A rendered prompt as the processor would tokenize it: each image's marker replaced by its text
        (Gemma 3); unchanged for a model whose image placeholder is a single token to expand."""
        return text if self.expansion is None else text.replace(*self.expansion)

    def encode(self, image: Image) -> Encoded:
        """Run the processor and the vision tower on ``image``: its placeholder ids and their embeddings."""
        if image.pixels is None:
            raise CacheError(f"Image {image.short} is known by its hash only (a cache file saved without pixels) and "
                             "this turn needs it again: send the image again, or save with save_cache(path, images=True).")
        try:
            out = self.processor(text=[self.expansion[0] if self.expansion else self.image_token], images=[image.pixels])
        except Exception as exc:  # the processor's own checks (sizes, modes...)
            raise InvalidMessageError(f"The model's processor could not take image {image.short}: {exc}.") from None
        ids = [int(t) for t in _ints(out["input_ids"])]
        extra = {k: mx.array(v) for k, v in out.items() if k not in ("input_ids", "attention_mask", "pixel_values")}
        first = end = ids.index(self.image_token_id)
        while end < len(ids) and ids[end] == self.image_token_id:
            end += 1
        ids = ids[first:end]  # the image's tokens (not a BOS, nor the boundary tokens around them: text)
        mask = {"mask": mx.ones((1, len(ids)), dtype=mx.int32)} if self._masked else {}  # Gemma 3's wants one
        features = self.vlm.get_input_embeddings(
            mx.array([ids]), mx.array(out["pixel_values"]), **extra, **mask
        ).inputs_embeds[0]  # one row per id: the image's features
        mx.eval(features)
        return Encoded(tuple(ids), features, extra)

    def embeddings(self, ids: Sequence[int], spans: Sequence[ImageSpan], start: int,
                   encoded: Callable[[str], Encoded]) -> mx.array:
        """The input embeddings of ``ids[start:]``: token embeddings, each image's features in its span."""
        embed = self.text.language_model.model.embed_tokens
        pieces, at = [], start
        for span in spans:
            if span.end <= at:
                continue
            lo = max(span.start, at)
            if lo > at:
                pieces.append(embed(mx.array(list(ids[at:lo]))))
            rows = encoded(span.digest).features
            assert rows is not None, "check() first"
            pieces.append(rows[lo - span.start : span.end - span.start])
            at = span.end
        if at < len(ids):
            pieces.append(embed(mx.array(list(ids[at:]))))
        return mx.concatenate(pieces, axis=0)

    def rope_index(self, ids: Sequence[int], spans: Sequence[ImageSpan]) -> tuple[mx.array, int]:
        """The model's M-RoPE positions of ``ids`` (3 x 1 x N, from 0), which hold the images ``spans``, and the
        delta of a text token after them (its position minus its index)."""
        layouts = [list(s.layout) for s in spans if s.layout]
        grid = mx.array(layouts).reshape(-1, 3) if layouts else None
        pos, delta = self.text.language_model.get_rope_index(mx.array([list(ids)]), grid)
        return pos, _ints(delta)[0]


class ImageTable:
    """One session's images: each encoded once (by content hash) for the session's lifetime."""

    def __init__(self, vision: Vision) -> None:
        self.vision = vision
        self.placeholder = vision.image_token_id
        self._encoded: dict[str, Encoded] = {}
        self._deltas: dict[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]], int] = {}  # see positions()
        self.encodings = 0  # how many times the vision tower ran (tests, stats)

    def ids(self, image: Image) -> tuple[int, ...]:
        """The placeholder ids of ``image`` (encoding it on first sight)."""
        return self.get(image).ids

    def layout(self, image: Image) -> tuple[int, ...]:
        return self.get(image).layout

    def get(self, image: Image) -> Encoded:
        found = self._encoded.get(image.digest)
        if found is None or (found.features is None and image.pixels is not None):
            found = self._encoded[image.digest] = self.vision.encode(image)
            self.encodings += 1
        return found

    def encoded(self, digest: str) -> Encoded:
        return self._encoded[digest]

    def check(self, spans: Sequence[ImageSpan], keep: int) -> None:
        """``CacheError`` if feeding the prompt after ``keep`` cached tokens needs an image's features that
        cannot be made: one known only from a restored cache file saved without pixels."""
        for span in spans:
            if span.end > keep and self._encoded[span.digest].features is None:
                raise CacheError(
                    f"This turn must prefill image {span.digest[:12]} again, and the restored cache file has "
                    "no pixels of it: send the image again in a message, or save with save_cache(path, images=True)."
                )

    def inputs(self, prompt: Sequence[int], spans: Sequence[ImageSpan], keep: int) -> VisionInput:
        """What a turn feeds after ``keep`` cached tokens of ``prompt``: the embeddings of the rest, and
        the model bound to the prompt's positions."""
        self.check(spans, keep)
        embeddings = self.vision.embeddings(prompt, spans, keep, self.encoded)
        return VisionInput(embeddings, Bound(self.vision.text, self.positions(prompt, spans, keep)))

    def positions(self, prompt: Sequence[int], spans: Sequence[ImageSpan], start: int) -> Positions | None:
        """The M-RoPE positions of ``prompt`` from ``start`` on (``None``: the model's positions are plain).

        After an image, positions go on as after text, shifted by a delta that only the ids and images before
        it set: that delta is kept per prefix (ids up to an image's end, and the images' grids), so a turn
        computes positions only from the end of the last image before ``start``: nothing, when the new tokens
        show no image."""
        if not self.vision.mrope:
            return None
        at = max((s.end for s in spans if s.end <= start), default=0)
        delta = self._delta(prompt, [s for s in spans if s.end <= at], at)
        later = [s for s in spans if s.end > at]
        if not later:
            return Positions(None, delta, at)
        pos, more = self.vision.rope_index(prompt[at:], later)
        end = later[-1].end
        self._remember((tuple(prompt[:end]), tuple(s.layout for s in spans if s.end <= end)), delta + more)
        return Positions(pos + (at + delta), delta + more, at)

    def _delta(self, prompt: Sequence[int], spans: Sequence[ImageSpan], end: int) -> int:
        """The delta after ``prompt[:end]``, which ends with the last of its images ``spans`` (computed once)."""
        if not spans:
            return 0
        key = (tuple(prompt[:end]), tuple(s.layout for s in spans))
        found = self._deltas.get(key)
        if found is None:
            found = self.vision.rope_index(prompt[:end], spans)[1]
            self._remember(key, found)
        return found

    def _remember(self, key: tuple[tuple[int, ...], tuple[tuple[int, ...], ...]], delta: int) -> None:
        self._deltas[key] = delta
        while len(self._deltas) > 8:  # a few prefixes: the conversation's, and those of turns undone
            del self._deltas[next(iter(self._deltas))]

    def restore(self, tokens: Sequence[int], spans: Sequence[ImageSpan]) -> None:
        """Learn the images of a restored cache (``tokens``: its ledger's): their ids and layout, not
        their features, which only their pixels can give again."""
        for span in spans:
            if span.digest not in self._encoded:
                extra = {"image_grid_thw": mx.array([list(span.layout)])} if span.layout else {}
                self._encoded[span.digest] = Encoded(tuple(tokens[span.start : span.end]), None, extra)

    def copy(self) -> ImageTable:
        other = ImageTable(self.vision)
        other._encoded = dict(self._encoded)
        other._deltas = dict(self._deltas)
        return other


def _lm_caches(caches: Sequence[Any]) -> list[Any]:
    """mlx-lm's cache layers for the layers an mlx-vlm model's ``make_cache`` gives (mlx-vlm has classes of
    its own, alike): plain and sliding-window (rotating) layers."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    out: list[Any] = []
    for c in caches:
        name = type(c).__name__
        if name == "KVCache":
            out.append(KVCache())
        elif name == "RotatingKVCache":
            out.append(RotatingKVCache(max_size=c.max_size, keep=c.keep))
        else:
            raise ModelLoadError(f"This vision-language model's language model keeps {name} cache layers, which "
                                 "chatkit cannot reuse across turns yet: run it with mlx-vlm directly.")
    return out


def _ints(values: Any) -> list[int]:
    """The integers of an array (mlx or NumPy), flattened."""
    return [int(v) for v in np.asarray(values).reshape(-1).tolist()]


def _token_id(processor: Any, token: str) -> int:
    found = getattr(processor, "image_token_id", None)
    if isinstance(found, int):
        return found
    if isinstance(found, (list, tuple)) and found:
        return int(found[0])
    return int(processor.tokenizer.convert_tokens_to_ids(token))


def load_vision(source: str, config: Mapping[str, Any]) -> tuple[TextModel, Any, Vision]:
    """mlx-vlm's model and processor from the local folder ``source``: (the language model as mlx-lm calls it, mlx-lm's
    tokenizer wrapper over the processor's tokenizer, the :class:`Vision`)."""
    try:
        from mlx_vlm.utils import load as vlm_load
    except ImportError:
        raise MissingDependencyError(
            f"{source!r} is a vision-language model: loading it needs the 'vision' extra (mlx-vlm): "
            "pip install 'chatkit[vision]'."
        ) from None
    from mlx_lm.utils import load_tokenizer

    try:
        vlm, processor = vlm_load(source)
    except Exception as exc:  # mlx-vlm raises many kinds
        raise ModelLoadError(f"Could not load vision-language model {source!r}: {exc} (check the folder holds "
                             "config.json, weights, processor and tokenizer files).") from exc
    if not hasattr(processor, "image_token"):
        raise ModelLoadError(f"{source!r}: its processor names no image token, so chatkit cannot place images.")
    eos = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
    eos_ids = set(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    tokenizer = load_tokenizer(Path(source), eos_token_ids=sorted(eos_ids) or None)
    vision = Vision(vlm, processor)
    return vision.text, tokenizer, vision


__all__ = ["MAX_IMAGES", "Bound", "Encoded", "ImageTable", "Positions", "TextModel", "Vision", "is_vision_config", "load_vision"]
