"""Fuzzing the image decoders every reader goes through (data_pipeline.codec): the loader's
``decode_into`` (both decoders), ``decode_image`` (evaluation sets, verify, the offline tools)
and the converters' ``prepare_jpeg``. Any bytes end as an image or a CorruptImageError (which
the loader skips and counts, and a converter names in one line) within the bounds of
tests/fuzz/bounds.py.

Seeds: the issue's JPEG (a 112x112 JPEG whose frame header claims 60000x60000), a 112x112
JPEG truncated at every byte, and damaged copies of it and of a PNG: flipped bits, huge
dimensions and segment lengths, random bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given

from data_pipeline.codec import decode_image, decode_into, prepare_jpeg, resolve_decoder
from data_pipeline.errors import CorruptImageError
from tests.fuzz.bounds import BOMB, JPEG, PNG, claiming, damaged, figures, fuzz_settings, one_line

DECODERS = sorted({"pil", resolve_decoder("auto")})


def _decode_all(tracked, data: bytes) -> None:
    """``data`` through every decoder path: an image of the right shape or a one-line
    CorruptImageError, within the bounds."""
    out = np.empty((112, 112, 3), np.uint8)
    for decoder in DECODERS:
        for call in (lambda d=decoder: decode_into(data, out, d),
                     lambda d=decoder: decode_image(data, 112, d).shape,
                     lambda: prepare_jpeg(data, 112), lambda: prepare_jpeg(data, None)):
            value, error = tracked.measure(call)
            if error is not None:
                one_line(error, (CorruptImageError,))
            tracked.count("refused" if error is not None else "decoded")


@pytest.fixture(scope="module")
def image_figures():
    with figures("image: codec.decode_into, decode_image, prepare_jpeg") as tracked:
        yield tracked


def test_the_issue_jpeg_is_refused_at_once(image_figures):
    """The issue's JPEG (here 751 bytes) claiming 60000x60000: refused from its header, in
    both decoders and the converter, without the 10.5 GB decode."""
    out = np.empty((112, 112, 3), np.uint8)
    for decoder in DECODERS:
        _, error = image_figures.measure(lambda d=decoder: decode_into(BOMB, out, d))
        # the project's words: PIL's own bomb error names pixels too, and is not the check
        assert "over the limit of 50000000 (refused before decoding)" in one_line(
            error, (CorruptImageError,))
        assert image_figures.last[0] < 1.0 and image_figures.last[1] < 64 << 20
    between = claiming(JPEG, 10000, 10000)  # over the limit, under PIL's own bomb error
    for decoder in DECODERS:  # so only the project's check refuses it, in its words
        _, error = image_figures.measure(lambda d=decoder: decode_into(between, out, d))
        assert one_line(error, (CorruptImageError,)) == (
            "header claims 10000x10000 pixels, over the limit of 50000000 (refused before "
            "decoding)")
    _, error = image_figures.measure(lambda: prepare_jpeg(BOMB, 112))
    assert "over the limit" in one_line(error, (CorruptImageError,))
    assert image_figures.last[0] < 1.0 and image_figures.last[1] < 64 << 20


def test_a_jpeg_truncated_at_every_byte(image_figures):
    for end in range(len(JPEG)):
        _decode_all(image_figures, JPEG[:end])


@fuzz_settings(examples=60)
@given(data=damaged(JPEG) | damaged(PNG) | damaged(BOMB))
@example(data=claiming(JPEG, 7000, 7000))  # under the limit: decoded (scaled) or refused
@example(data=claiming(JPEG, 65535, 1))
def test_damaged_images(image_figures, data):
    _decode_all(image_figures, data)
