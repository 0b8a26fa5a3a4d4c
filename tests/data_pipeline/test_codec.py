"""``codec.decode_into``: the loader's decode into a batch row equals ``decode_image`` (and
its mirror) byte for byte, on every path (simplejpeg, PIL, other sizes, PNG, corrupt)."""

import io

import numpy as np
import pytest
from PIL import Image

from data_pipeline.codec import Mirror, decode_image, decode_into, resolve_decoder
from data_pipeline.errors import CorruptImageError


def _encoded(size, fmt="JPEG") -> bytes:
    rng = np.random.default_rng(size[0])
    image = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)  # every channel differs
    out = io.BytesIO()
    Image.fromarray(image).save(out, fmt)
    return out.getvalue()


@pytest.mark.parametrize("decoder", ["pil", resolve_decoder("auto")])
@pytest.mark.parametrize("size,fmt", [((112, 112), "JPEG"), ((64, 80), "JPEG"),
                                      ((200, 160), "JPEG"), ((112, 112), "PNG")])
@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("side", [112, 100])  # rows of 336 bytes (8-byte words) and of 300
def test_decode_into_equals_decode_image(decoder, size, fmt, flip, side):
    data = _encoded(size, fmt)
    want = decode_image(data, side, decoder)
    out = np.full((side, side, 3), 7, np.uint8)
    decode_into(data, out, decoder, Mirror(side) if flip else None)
    np.testing.assert_array_equal(out, want[:, ::-1] if flip else want)


@pytest.mark.parametrize("flip", [False, True])
def test_decode_into_refuses_corrupt_bytes(flip):
    data = _encoded((112, 112))
    with pytest.raises(CorruptImageError):
        decode_into(data[:200], np.empty((112, 112, 3), np.uint8), resolve_decoder("auto"),
                    Mirror(112) if flip else None)
