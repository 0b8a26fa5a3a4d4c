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
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from data_pipeline.errors import CorruptImageError

try:
    import simplejpeg
except ImportError:  # optional speed-up; PIL decodes everything too
    simplejpeg = None

JPEG_MAGIC = b"\xff\xd8\xff"
JPEG_QUALITY = 95


def is_jpeg(data: bytes) -> bool:
    return data[:3] == JPEG_MAGIC


def _decode_pil(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def _decode_simplejpeg(data: bytes) -> np.ndarray:
    if not is_jpeg(data):
        return _decode_pil(data)
    return simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True)


DECODERS = {"pil": _decode_pil, "simplejpeg": _decode_simplejpeg}


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


def decode_image(data: bytes, size: int = 112, decoder: str = "auto") -> np.ndarray:
    """Encoded bytes -> uint8 RGB array [size, size, 3]; CorruptImageError if undecodable.

    decoder: a name from DECODERS, or "auto" (resolved per call: hot loops pass a name).
    """
    if decoder not in DECODERS:
        decoder = resolve_decoder(decoder)
    try:
        image = DECODERS[decoder](data)
    except (ValueError, OSError, SyntaxError, Image.DecompressionBombError) as exc:
        raise CorruptImageError(f"undecodable image ({type(exc).__name__}: {exc})") from exc
    return resize_square(image, size)


def decode_into(data: bytes, out: np.ndarray, decoder: str, flip: bool = False,
                scratch: np.ndarray | None = None) -> None:
    """Decode into ``out`` (uint8 ``[size, size, 3]``, C-contiguous), mirrored left-right if
    ``flip``; CorruptImageError if undecodable. Writing into the caller's batch saves the
    copy of a returned array; a JPEG of another size (or a PNG) takes :func:`decode_image`'s
    path (decode, stretch) and is copied in.

    The mirror decodes as BGR and reverses each row's bytes, which reverses the pixels and
    turns BGR into RGB in one pass (:func:`_reverse_rows`; numpy's pixel-wise ``[:, ::-1]``
    copy costs about as much as decoding a 112x112 JPEG). It goes through ``scratch`` (an
    array like ``out``; a new one when None): decoded into ``out``, copied to ``scratch`` and
    reversed back while both are still in cache.
    """
    if decoder == "simplejpeg":  # not a JPEG (a PNG stored by hand): ValueError, then PIL
        try:
            got = simplejpeg.decode_jpeg(data, colorspace="BGR" if flip else "RGB",
                                         strict=True, buffer=out)
            if got.shape == out.shape:
                if flip:
                    scratch = np.empty_like(out) if scratch is None else scratch
                    np.copyto(scratch, out)
                    _reverse_rows(scratch.reshape(len(out), -1), out.reshape(len(out), -1))
                return
        except ValueError:  # corrupt, not a JPEG or larger than `out`: decode_image tells which
            pass
    image = decode_image(data, out.shape[0], decoder)
    np.copyto(out, image[:, ::-1] if flip else image)


_SWAPPED_WORDS = np.dtype(np.uint64).newbyteorder()


def _reverse_rows(source: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = source[i][::-1]`` for uint8 rows: 8-byte words in reverse order, each
    byte-swapped by numpy's cast from the foreign byte order (3x faster than a byte-wise
    reversed copy, which numpy does not vectorise). Rows whose length is not a multiple of 8
    take the byte-wise copy."""
    if source.shape[1] % 8:
        np.copyto(out, source[:, ::-1])
        return
    np.copyto(out.view(np.uint64), source.view(_SWAPPED_WORDS)[:, ::-1], casting="unsafe")


def prepare_jpeg(data: bytes, size: int | None) -> bytes:
    """Bytes to store in a shard: JPEG already `size`x`size` (or any JPEG when size is None)
    is kept verbatim; anything else is decoded, stretched to size x size and re-encoded.

    Raises CorruptImageError when a file that must be re-encoded cannot be decoded.
    """
    if is_jpeg(data) and (size is None or _jpeg_size(data) == (size, size)):
        return data
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            mode = "L" if im.mode in ("L", "I;16", "I", "1") else "RGB"
            im = im.convert(mode)
            if size is not None and im.size != (size, size):
                im = im.resize((size, size), Image.BILINEAR)
            out = io.BytesIO()
            im.save(out, format="JPEG", quality=JPEG_QUALITY)
    except (ValueError, OSError, SyntaxError, Image.DecompressionBombError) as exc:
        raise CorruptImageError(f"undecodable image ({type(exc).__name__}: {exc})") from exc
    return out.getvalue()


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the JPEG header, None when the header is unreadable."""
    try:
        if simplejpeg is not None:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            return width, height
        with Image.open(io.BytesIO(data)) as im:
            return im.size
    except (ValueError, OSError, SyntaxError):
        return None
