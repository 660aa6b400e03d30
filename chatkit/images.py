"""Images in messages: what an image input may be, its content hash, and where its tokens sit in a prompt.

An image is read once, when a message takes it: a path, bytes, a data URL, a PIL image or a uint8 array
(H x W x 3 or 4, or H x W) becomes an :class:`Image`, RGB pixels and the SHA-256 of them (with the size),
so the same picture given as a file or as bytes is the same image to the cache. An unreadable or
oversized image is refused here, before anything else happens.

Encoded images (a path, bytes, a data URL) are decoded only if they are PNG, JPEG, WebP or GIF: their
magic bytes are checked before Pillow sees them and Pillow is told to try those formats alone, so no
other decoder (Pillow's EPS plugin runs Ghostscript on client bytes) and no subprocess is ever reached.
Inside :func:`images_refused` (a server serving a text model) every image is refused before decoding.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidMessageError, MissingDependencyError

MAX_IMAGE_PIXELS = 50_000_000  # larger images are refused (decompression bombs, runaway memory)
MAX_IMAGE_BYTES = 64 * 1024 * 1024
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # the only formats chatkit decodes (Pillow's names)
_REFUSED: ContextVar[str | None] = ContextVar("chatkit_images_refused", default=None)


@contextmanager
def images_refused(reason: str) -> Iterator[None]:
    """Within the block, :func:`as_image` refuses every image with ``reason`` before reading a byte of it
    (a server serving a model that reads no images)."""
    token = _REFUSED.set(reason)
    try:
        yield
    finally:
        _REFUSED.reset(token)


@dataclass(frozen=True)
class Image:
    """An image of a message: ``digest`` (hex SHA-256 of size and RGB pixels) names it; ``pixels`` is the
    PIL image, ``None`` for an image known only by its hash (a restored session saved without pixels)."""

    digest: str
    width: int
    height: int
    pixels: Any = field(default=None, compare=False, repr=False)

    @property
    def short(self) -> str:
        return self.digest[:12]


@dataclass(frozen=True)
class ImageSpan:
    """The tokens ``[start, end)`` of a prompt that an image (``digest``) fills."""

    start: int
    end: int
    digest: str
    layout: tuple[int, ...] = ()
    """The processor's grid of the image (temporal, height, width patches) when the model's positions
    depend on it (Qwen2-VL's M-RoPE); empty otherwise."""


def image_part(image: Image, *, pixels: bool = False) -> dict[str, Any]:
    """``image`` as a content part chatkit writes to its own files: its hash and size, and with ``pixels``
    a PNG data URL of them (``as_image`` / ``ChatMessage.from_dict`` read both back)."""
    part: dict[str, Any] = {"type": "image", "digest": image.digest, "width": image.width, "height": image.height}
    if pixels and image.pixels is not None:
        buffer = io.BytesIO()
        image.pixels.save(buffer, format="PNG")
        part["image"] = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
    return part


def from_part(part: Any) -> Image:
    """The image of a content part ``{"type": "image", ...}``: its ``image`` (``url`` / ``path``) read, or an
    image known by its hash alone (``digest``, ``width``, ``height``: chatkit's files without pixels)."""
    source = next((part[k] for k in ("image", "url", "path") if part.get(k) is not None), None)
    digest = part.get("digest")
    if source is None and isinstance(digest, str) and len(digest) == 64:
        width, height = part.get("width"), part.get("height")
        if not (isinstance(width, int) and isinstance(height, int)):
            raise InvalidMessageError("An image part known by its digest needs its 'width' and 'height'.")
        return Image(digest, width, height)
    if source is None:
        raise InvalidMessageError("An image content part needs 'image' (a path, bytes, a PIL image or an array).")
    image = as_image(source)
    if isinstance(digest, str) and digest != image.digest:
        raise InvalidMessageError(f"The image's pixels do not match its digest {digest[:12]}: it was changed.")
    return image


def as_image(value: Any) -> Image:
    """``value`` (an :class:`Image`, path, bytes, data URL, PIL image or array) read as an :class:`Image`;
    ``InvalidMessageError`` if it cannot be read or is too large."""
    if isinstance(value, Image):
        return value
    refused = _REFUSED.get()
    if refused is not None:
        raise InvalidMessageError(refused)
    pil = _pil()
    if isinstance(value, pil.Image):
        return _from_pil(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _decode(bytes(value), "the image bytes")
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if isinstance(text, str) and text.startswith("data:"):
            return _decode(_data_url(text), "the data URL")
        return _from_path(text)
    if hasattr(value, "__array_interface__") or type(value).__module__.startswith("numpy"):
        return _from_array(value)
    raise InvalidMessageError(
        f"An image must be a path, bytes, a data URL, a PIL image or an array, got {type(value).__name__}."
    )


def _pil() -> Any:
    try:
        from PIL import Image as PILImage
    except ImportError:  # pragma: no cover - the vision extra brings pillow
        raise MissingDependencyError("Images need Pillow: pip install 'chatkit[vision]'.") from None
    return PILImage


def _from_pil(img: Any) -> Image:
    width, height = img.size
    if width * height > MAX_IMAGE_PIXELS:
        raise InvalidMessageError(
            f"The image is {width}x{height} pixels, more than {MAX_IMAGE_PIXELS:,}: scale it down first."
        )
    if width < 1 or height < 1:
        raise InvalidMessageError(f"The image is empty ({width}x{height} pixels).")
    rgb = img.convert("RGB")
    digest = hashlib.sha256(f"{width}x{height}:".encode() + rgb.tobytes()).hexdigest()
    return Image(digest, width, height, rgb)


def _format(data: bytes) -> str | None:
    """The allowed format ``data`` starts as (its magic bytes), ``None`` for any other."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    return None


def _decode(data: bytes, what: str) -> Image:
    pil = _pil()
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidMessageError(f"{what} hold {len(data):,} bytes, more than {MAX_IMAGE_BYTES:,}: use a smaller image.")
    kind = _format(data)
    if kind is None:  # checked here so that Pillow never picks a plugin (EPS runs Ghostscript) for these bytes
        raise InvalidMessageError(f"Could not read {what} as an image: it is not a PNG, JPEG, WebP or GIF image "
                                  "(the only formats chatkit reads).")
    try:
        with pil.open(io.BytesIO(data), formats=[kind]) as img:
            if img.size[0] * img.size[1] > MAX_IMAGE_PIXELS:
                return _from_pil(img)  # refuses it before decoding the pixels
            img.load()
            return _from_pil(img)
    except InvalidMessageError:
        raise
    except Exception:  # PIL raises several kinds; their text quotes server internals (buffer addresses, paths)
        raise InvalidMessageError(f"Could not read {what} as an image: its {kind} data is damaged or cut short.") from None


def _from_path(path: str) -> Image:
    if not os.path.isfile(path):
        raise InvalidMessageError(f"No image file at {path!r}: check the path.")
    if os.path.getsize(path) > MAX_IMAGE_BYTES:
        raise InvalidMessageError(f"The image file {path!r} is larger than {MAX_IMAGE_BYTES:,} bytes.")
    with open(path, "rb") as f:
        return _decode(f.read(), f"the file {path!r}")


def _data_url(url: str) -> bytes:
    head, _, payload = url.partition(",")
    if not head.startswith("data:image/") or ";base64" not in head or not payload:
        raise InvalidMessageError("An image data URL must look like 'data:image/png;base64,<data>'.")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidMessageError("The image data URL's base64 data is not valid.") from None


def _from_array(value: Any) -> Image:
    import numpy as np

    array = np.asarray(value)
    if array.dtype != np.uint8 or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)):
        raise InvalidMessageError(
            f"An image array must be uint8, H x W or H x W x 3/4, got {array.dtype} of shape {array.shape}."
        )
    if array.shape[0] * array.shape[1] > MAX_IMAGE_PIXELS:
        raise InvalidMessageError(f"The image array is {array.shape[1]}x{array.shape[0]} pixels: scale it down first.")
    return _from_pil(_pil().fromarray(np.ascontiguousarray(array)))


__all__ = ["IMAGE_FORMATS", "MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "Image", "ImageSpan", "as_image", "from_part",
           "image_part", "images_refused"]
