"""Image placeholders in a rendered prompt: one per image from the model's own template, expanded to each
image's tokens (as the model's processor writes them), and where each image's tokens are."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import TemplateError
from ..images import Image, ImageSpan


def expand(ids: Sequence[int], images: Sequence[Image], placeholder: int,
           tokens_of: Callable[[Image], Sequence[int]]) -> list[int]:
    """``ids`` with the k-th ``placeholder`` replaced by the k-th image's tokens; ``TemplateError`` when the
    template did not place one placeholder per image."""
    out: list[int] = []
    k = at = 0
    for image in images:  # list.index: no Python loop over every id of a long conversation
        try:
            found = ids.index(placeholder, at)
        except ValueError:
            break
        out.extend(ids[at:found])
        out.extend(tokens_of(image))
        k, at = k + 1, found + 1
    out.extend(ids[at:])
    if k != len(images):
        raise TemplateError(f"The chat template placed {k} of {len(images)} images: does it render image parts?")
    return out


def locate(ids: Sequence[int], images: Sequence[Image], placeholder: int,
           tokens_of: Callable[[Image], Sequence[int]],
           layout_of: Callable[[Image], tuple[int, ...]] = lambda _: ()) -> tuple[ImageSpan, ...]:
    """Where each of ``images`` (in order) sits in the expanded ``ids`` (with its ``layout_of``)."""
    spans: list[ImageSpan] = []
    at = 0
    for image in images:
        tokens = tuple(tokens_of(image))
        first = tokens.index(placeholder) if placeholder in tokens else 0
        try:
            at = ids.index(placeholder, at)
        except ValueError:
            at = len(ids)
        start = at - first
        if at >= len(ids) or tuple(ids[start : start + len(tokens)]) != tokens:
            raise TemplateError("An image's tokens are not where the template placed it.")
        spans.append(ImageSpan(start, start + len(tokens), image.digest, layout_of(image)))
        at = start + len(tokens)
    return tuple(spans)


__all__ = ["expand", "locate"]
