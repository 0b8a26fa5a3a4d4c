"""JPEG decoding for the loader and JPEG normalisation for the converters.

Decoder choice: simplejpeg (libjpeg-turbo, accurate DCT) decodes 112x112 JPEGs faster than
PIL (docs/benchmarks.md, "Loader"; `bench/loader.py`), so `"auto"` picks simplejpeg when it
is importable and falls back to PIL.
Non-JPEG bytes (a PNG stored by hand) go through PIL. simplejpeg runs with strict=True, so
a JPEG libjpeg-turbo reports as corrupt (e.g. truncated) counts as undecodable.

Size policy: converters store `size`x`size` images (`prepare_jpeg`: JPEGs already that size
are kept byte for byte, anything else is decoded, stretched to the square with bilinear
filtering and re-encoded at quality 95). The decoder stretches any image that is still not
`size`x`size` (shards written with `--size 0`), so the loader always yields 112x112.

Pixel limit: an image's header is read before its pixels (simplejpeg's
``decode_jpeg_header``, PIL's lazy ``open``), and one that claims more than ``max_pixels``
(:data:`MAX_PIXELS` by default; the loader's ``data.max_pixels``, ``launch.convert
--max-pixels``) is a
:class:`CorruptImageError` before anything is allocated for it: a 600-byte JPEG whose frame
header claims 60000x60000 cost the loader 10.5 GB and half a minute before it was called
corrupt. The converters decode large JPEGs scaled down in libjpeg (PIL's ``draft``: DCT
scaling to the smallest of 1/2, 1/4, 1/8 that still covers ``size``), which is also faster,
and so does the loader for a shard written with ``--size 0`` (simplejpeg's ``min_width``):
a 49 MP JPEG, just under the limit, took seconds to decode and stretch whole.
"""

from __future__ import annotations

import contextlib
import io
import struct
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image

from data_pipeline.door import read_bytes
from data_pipeline.errors import CorruptImageError

try:
    import simplejpeg
except ImportError:  # optional speed-up; PIL decodes everything too
    simplejpeg = None

FORMATS = ("JPEG", "PNG", "BMP", "PPM", "TIFF", "WEBP")
"""What PIL may open: the formats a face set holds (``imagefolder``'s suffixes, ORL's
``.pgm``); without ``formats=`` it tries every plugin it has, and an EPS posing as a shard
member runs Ghostscript."""
MAX_IMAGE_BYTES = 256 << 20  # an image file: a 50 MP photo is ~20 MB as a JPEG
JPEG_MAGIC = b"\xff\xd8\xff"
JPEG_QUALITY = 95
MAX_PIXELS = 50_000_000
"""Default pixel limit (width x height as the header states it): no face crop or source
photo reaches it (a 50 MP camera's frame is 8192 x 6144); the evaluation readers use it, the
loader takes ``data.max_pixels`` (this by default), the converters ``--max-pixels``."""


def is_jpeg(data: bytes) -> bool:
    return data[:3] == JPEG_MAGIC


def check_pixels(width: int, height: int, max_pixels: int) -> None:
    """CorruptImageError when a header's ``width`` x ``height`` exceeds ``max_pixels``."""
    if width * height > max_pixels:
        raise CorruptImageError(f"header claims {width}x{height} pixels, over the limit of "
                                f"{max_pixels} (refused before decoding)")


@contextlib.contextmanager
def open_image(data: bytes, max_pixels: int) -> Iterator[Image.Image]:
    """PIL's lazy ``open`` of ``data`` (its header only) in one of :data:`FORMATS`, its
    ``width`` x ``height`` checked against ``max_pixels`` before anything decodes it. PIL's
    own bomb check speaks for it no more: its warning (over 89 M pixels) is not printed, and
    its error (over 179 M, raised inside ``open``) becomes this module's refusal."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise CorruptImageError(f"header claims more than {2 * Image.MAX_IMAGE_PIXELS} "
                                f"pixels, over the limit of {max_pixels} (refused before "
                                "decoding)") from None
    with im:
        check_pixels(*im.size, max_pixels)
        yield im


def _decode_pil(data: bytes, max_pixels: int, min_size: int) -> np.ndarray:
    with open_image(data, max_pixels) as im:
        if min_size:
            im.draft("RGB", (min_size, min_size))
        return np.asarray(im.convert("RGB"))


def _decode_simplejpeg(data: bytes, max_pixels: int, min_size: int) -> np.ndarray:
    if not is_jpeg(data):
        return _decode_pil(data, max_pixels, min_size)
    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    check_pixels(width, height, max_pixels)
    return simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True, min_height=min_size,
                                  min_width=min_size)


DECODERS = {"pil": _decode_pil, "simplejpeg": _decode_simplejpeg}
# What a decoder raises for bytes it cannot decode (PIL's plugins raise the last three too)
UNDECODABLE = (ValueError, OSError, SyntaxError, Image.DecompressionBombError, EOFError,
               IndexError, struct.error)


def read_image_file(path: Path, what: str) -> bytes:
    """An evaluation set's image file, undecoded, through the door (at most
    :data:`MAX_IMAGE_BYTES`); an unreadable one raises DataError naming it and the set
    (``what``)."""
    return read_bytes(path, f"{what} image", limit=MAX_IMAGE_BYTES)


def resolve_decoder(name: str = "auto") -> str:
    """Map `auto` to the fastest installed decoder; reject unknown names."""
    if name == "auto":
        return "simplejpeg" if simplejpeg is not None else "pil"
    if name not in DECODERS or (name == "simplejpeg" and simplejpeg is None):
        raise ValueError(f"decoder={name!r} unavailable; choose from auto, pil"
                         + (", simplejpeg" if simplejpeg is not None else ""))
    return name


def resize_square(image: np.ndarray, size: int) -> np.ndarray:
    """Stretch an HWC (or HW) uint8 image to size x size, bilinear; no-op if already that size."""
    if image.shape[0] == size and image.shape[1] == size:
        return image
    return np.asarray(Image.fromarray(image).resize((size, size), Image.BILINEAR))


def decode_rgb(data: bytes, decoder: str = "auto", max_pixels: int = MAX_PIXELS,
               min_size: int = 0) -> np.ndarray:
    """Encoded bytes -> uint8 RGB array [H, W, 3] as stored (a JPEG at least twice
    ``min_size`` on both sides decoded at libjpeg's DCT scale that still covers it: 1/2, 1/4
    or 1/8); CorruptImageError if undecodable or larger than ``max_pixels``.

    decoder: a name from DECODERS, or "auto" (resolved per call: hot loops pass a name).
    """
    if decoder not in DECODERS:
        decoder = resolve_decoder(decoder)
    try:
        return DECODERS[decoder](data, max_pixels, min_size)
    except CorruptImageError:
        raise
    except UNDECODABLE as exc:
        raise CorruptImageError(f"undecodable image ({type(exc).__name__}: {exc})") from exc


def decode_image(data: bytes, size: int = 112, decoder: str = "auto",
                 max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Encoded bytes -> uint8 RGB array [size, size, 3] (:func:`decode_rgb` at the DCT scale
    that covers ``size``, stretched)."""
    return resize_square(decode_rgb(data, decoder, max_pixels, size), size)


def decode_into(data: bytes, out: np.ndarray, decoder: str,
                mirror: Mirror | None = None, max_pixels: int = MAX_PIXELS) -> None:
    """Decode into ``out`` (uint8 ``[size, size, 3]``, C-contiguous), mirrored left-right by
    ``mirror`` when one is given; CorruptImageError if undecodable or over ``max_pixels``
    (its header is read once the fast path has failed: that path decodes only what fits in
    ``out``, so a limit of at least ``size`` x ``size`` holds on both). Writing into the caller's
    batch saves the copy of a returned array; a JPEG of another size (or a PNG) takes
    :func:`decode_image`'s path (decode, stretch) and is copied in.

    A mirrored JPEG is decoded as BGR, which :class:`Mirror` turns into the mirrored RGB.
    """
    if decoder == "simplejpeg":  # not a JPEG (a PNG stored by hand): ValueError, then PIL
        try:
            got = simplejpeg.decode_jpeg(data, colorspace="RGB" if mirror is None else "BGR",
                                         strict=True, buffer=out)
            if got.shape == out.shape:
                if mirror is not None:
                    mirror(out)
                return
        except ValueError:  # corrupt, not a JPEG or larger than `out`: decode_image tells which
            pass
    image = decode_image(data, out.shape[0], decoder, max_pixels)
    np.copyto(out, image if mirror is None else image[:, ::-1])


class Mirror:
    """Turns a ``size`` x ``size`` BGR image into its left-right mirror in RGB, in place.

    Reversing each row's bytes reverses the pixels and turns BGR into RGB in one pass: 8-byte
    words in reverse order, each byte-swapped by numpy's cast from the foreign byte order (3x
    faster than a byte-wise reversed copy, which numpy does not vectorise; numpy's pixel-wise
    ``[:, ::-1]`` copy costs about as much as decoding a 112x112 JPEG). Rows whose length is
    not a multiple of 8 take the byte-wise copy. The image is copied into a scratch image,
    while both are in cache, and reversed back; the scratch's reversed view is made once (a
    numpy call costs a third of the copy).
    """

    def __init__(self, size: int):
        self.scratch = np.empty((size, size, 3), np.uint8)
        rows = self.scratch.reshape(size, size * 3)
        self.in_words = size * 3 % 8 == 0
        self.reversed = (rows.view(np.dtype(np.uint64).newbyteorder()) if self.in_words
                         else rows)[:, ::-1]

    def __call__(self, image: np.ndarray) -> None:
        np.copyto(self.scratch, image)
        rows = image.reshape(len(image), -1)
        np.copyto(rows.view(np.uint64) if self.in_words else rows, self.reversed,
                  casting="unsafe")


def prepare_jpeg(data: bytes, size: int | None, max_pixels: int = MAX_PIXELS) -> bytes:
    """Bytes to store in a shard: JPEG already `size`x`size` (or any JPEG when size is None)
    is kept verbatim; anything else is decoded (a JPEG at the DCT scale that still covers
    `size`), stretched to size x size and re-encoded.

    Raises CorruptImageError when a file that must be re-encoded cannot be decoded, or when
    any file's header claims more than ``max_pixels``.
    """
    if is_jpeg(data):
        stored = _jpeg_size(data)
        if stored is not None:
            check_pixels(*stored, max_pixels)
        if size is None or stored == (size, size):
            return data
    try:
        with open_image(data, max_pixels) as im:
            if size is not None:
                im.draft(None, (size, size))
            im.load()
            mode = "L" if im.mode in ("L", "I;16", "I", "1") else "RGB"
            im = im.convert(mode)
            if size is not None and im.size != (size, size):
                im = im.resize((size, size), Image.BILINEAR)
            out = io.BytesIO()
            im.save(out, format="JPEG", quality=JPEG_QUALITY)
    except CorruptImageError:
        raise
    except UNDECODABLE as exc:
        raise CorruptImageError(f"undecodable image ({type(exc).__name__}: {exc})") from exc
    return out.getvalue()


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the JPEG header, None when the header is unreadable."""
    try:
        if simplejpeg is not None:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            return width, height
        with open_image(data, sys.maxsize) as im:
            return im.size
    except (*UNDECODABLE, CorruptImageError):
        return None
