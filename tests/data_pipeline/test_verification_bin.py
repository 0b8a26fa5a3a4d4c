"""Verification .bin round trip and the restricted unpickler."""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest
from PIL import Image

from data_pipeline.verification_bin import UnsafeBinError, read_bin, write_bin


def _jpeg(value: int, size: int = 112) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size, size, 3), value, np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def test_round_trip(tmp_path):
    images = [_jpeg(v) for v in (0, 60, 120, 250)]
    path = tmp_path / "set.bin"
    write_bin(path, images, [True, False])
    got_images, got_same = read_bin(path)
    assert got_images == images and got_same == [True, False]
    assert not (tmp_path / "set.bin.tmp").exists()


def test_reads_python2_style_pickle(tmp_path):
    # Hand-assembled protocol-2 pickle as Python 2 writes (["ab", "cd"], [True]):
    # PROTO 2, EMPTY_LIST, MARK, SHORT_BINSTRING x2, APPENDS, EMPTY_LIST, NEWTRUE,
    # APPEND, TUPLE2, STOP (with the BINPUT memo opcodes Python 2 emits).
    raw = b"\x80\x02]q\x00(U\x02abq\x01U\x02cdq\x02e]q\x03\x88a\x86q\x04."
    (tmp_path / "py2.bin").write_bytes(raw)
    assert read_bin(tmp_path / "py2.bin") == ([b"ab", b"cd"], [True])


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.bin"
    path.write_bytes(pickle.dumps(([_Evil(marker), b"x"], [True]), protocol=2))
    with pytest.raises(UnsafeBinError, match=r"evil\.bin: refusing to unpickle global .*system"):
        read_bin(path)
    assert not marker.exists()
    # Sanity check that the payload is live: an ordinary unpickler would run it.
    pickle.loads(path.read_bytes())
    assert marker.exists()


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (({"a": 1}, [True]), "images must be a list of bytes"),
        (([b"a", b"b"], [2]), "issame must be a list of bools"),
        (([b"a"], [True]), "1 images for 1 pairs"),
        ([b"a"], "expected a pair"),
        (([np.zeros(2)], [True]), "refusing to unpickle global"),
    ],
)
def test_wrong_content_is_refused(tmp_path, payload, match):
    path = tmp_path / "bad.bin"
    path.write_bytes(pickle.dumps(payload))
    with pytest.raises(UnsafeBinError, match=match):
        read_bin(path)


def test_truncated_file(tmp_path):
    path = tmp_path / "cut.bin"
    path.write_bytes(pickle.dumps(([b"a", b"b"], [True]))[:-3])
    with pytest.raises(UnsafeBinError, match="not a readable verification .bin"):
        read_bin(path)


def test_inst_and_extension_opcodes_are_refused(tmp_path):
    """INST (protocol 0: the class named inline) and EXT1 (copyreg's extension registry)
    reach a callable without a GLOBAL opcode; both must go through find_class too."""
    import copyreg

    marker = tmp_path / "pwned"
    inst = b"((S'touch %s'\nios\nsystem\nlp0\n(I1\nltp1\n." % str(marker).encode()
    ext = b"\x80\x02(\x82\xf0S'touch %s'\n\x85R]\x88\x86." % str(marker).encode()
    copyreg.add_extension("os", "system", 240)
    try:
        for raw in (inst, ext):
            (tmp_path / "op.bin").write_bytes(raw)
            with pytest.raises(UnsafeBinError, match="refusing to unpickle global os.system"):
                read_bin(tmp_path / "op.bin")
        assert not marker.exists()
        pickle.loads(ext)  # sanity: the EXT payload is live for an ordinary unpickler
        assert marker.exists()
    finally:
        copyreg.remove_extension("os", "system", 240)
