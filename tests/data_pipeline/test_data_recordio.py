"""RecordIO reading and the insightface converter, against files built from the format spec.

The files here are assembled with struct.pack from the format description (dmlc-core
recordio + mx.recordio.pack), never with the reader under test.
"""

import io
import struct

import numpy as np
import pytest
from PIL import Image

from data_pipeline import make_loader, read_manifest
from data_pipeline.errors import DataError
from data_pipeline.identities import read_identities
from data_pipeline.insightface import InsightFaceSource
from data_pipeline.recordio import RecordIOReader, unpack
from data_pipeline.tar_reader import tar_samples
from launch.convert import main

MAGIC = struct.pack("<I", 0xCED7230A)


def frame(cflag: int, payload: bytes) -> bytes:
    """One physical record: magic, lrecord = cflag << 29 | length, payload, zero padding."""
    pad = (-len(payload)) % 4
    return MAGIC + struct.pack("<I", cflag << 29 | len(payload)) + payload + b"\0" * pad


def encode_record(payload: bytes) -> bytes:
    """dmlc RecordIOWriter::WriteRecord: split at every 4-aligned occurrence of the magic."""
    cuts = [i for i in range(0, len(payload) - 3, 4) if payload[i:i + 4] == MAGIC]
    if not cuts:
        return frame(0, payload)
    out, start = b"", 0
    for n, i in enumerate(cuts):
        out += frame(1 if n == 0 else 2, payload[start:i])
        start = i + 4
    return out + frame(3, payload[start:])


def ir_payload(label, image: bytes, id1: int = 0) -> bytes:
    """mx.recordio.pack: 24-byte header (flag, float label, id, id2), label vector, image."""
    if isinstance(label, tuple):
        return (struct.pack("<IfQQ", len(label), 0.0, id1, 0)
                + struct.pack(f"<{len(label)}f", *label) + image)
    return struct.pack("<IfQQ", 0, float(label), id1, 0) + image


def write_rec(folder, payloads: dict[int, bytes], num_classes: int | None = None):
    rec, idx = b"", []
    for key, payload in payloads.items():
        idx.append(f"{key}\t{len(rec)}\n")
        rec += encode_record(payload)
    (folder / "train.rec").write_bytes(rec)
    (folder / "train.idx").write_text("".join(idx))
    if num_classes is not None:
        (folder / "property").write_text(f"{num_classes},112,112\n")


def jpeg(seed: int, size: int = 112) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(out, "JPEG")
    return out.getvalue()


def test_hand_assembled_record_byte_by_byte(tmp_path):
    image = b"\xff\xd8\xff\xe0JPEG!"  # 9 bytes -> payload 33 bytes, 3 padding bytes
    expected = bytes.fromhex(
        "0a23d7ce" "21000000"                      # magic; lrecord: cflag 0, length 33
        "00000000" "0000e040"                      # flag 0; label 7.0f
        "0500000000000000" "0000000000000000"      # id 5; id2 0
        "ffd8ffe04a50454721" "000000"              # image bytes; zero padding
    )
    record = (struct.pack("<II", 0xCED7230A, 33) + struct.pack("<IfQQ", 0, 7.0, 5, 0)
              + image + b"\0\0\0")
    assert record == expected
    (tmp_path / "a.rec").write_bytes(expected + encode_record(ir_payload(2.0, b"z")))
    (tmp_path / "a.idx").write_text("0\t0\n1\t44\n")
    with RecordIOReader(tmp_path / "a.rec", tmp_path / "a.idx") as reader:
        payload, second = reader.read(0), reader.read(1)
    assert payload == expected[8:41]
    header, body = unpack(payload)
    assert (header.flag, header.label, header.id, header.id2) == (0, 7.0, 5, 0)
    assert body == image
    assert unpack(second)[0].label == 2.0 and unpack(second)[1] == b"z"


def test_multipart_record_and_label_vector(tmp_path):
    # payload = header(flag 2) + labels (3.0, 9.0) + 4 bytes + MAGIC + 3 bytes, split by hand:
    head = struct.pack("<IfQQ", 2, 0.0, 0, 0) + struct.pack("<2f", 3.0, 9.0) + b"abcd"
    tail = b"xyz"
    assert len(head) % 4 == 0
    rec = (MAGIC + struct.pack("<I", 1 << 29 | len(head)) + head
           + MAGIC + struct.pack("<I", 3 << 29 | len(tail)) + tail + b"\0")
    (tmp_path / "b.rec").write_bytes(rec)
    (tmp_path / "b.idx").write_text("4\t0\n")
    reader = RecordIOReader(tmp_path / "b.rec", tmp_path / "b.idx")
    payload = reader.read(4)
    assert payload == head + MAGIC + tail
    assert encode_record(payload) == rec  # the test's writer agrees with the hand assembly
    header, body = unpack(payload)
    assert header.flag == 2 and header.label == (3.0, 9.0) and body == b"abcd" + MAGIC + tail


def test_bad_magic_and_truncation_name_the_file(tmp_path):
    good = encode_record(ir_payload(1, b"\xff\xd8\xff" + b"x" * 40))
    (tmp_path / "c.idx").write_text("0\t0\n")
    (tmp_path / "c.rec").write_bytes(b"\0" + good[1:])
    with pytest.raises(DataError, match=r"c\.rec: bad magic"):
        RecordIOReader(tmp_path / "c.rec", tmp_path / "c.idx").read(0)
    (tmp_path / "c.rec").write_bytes(good[:20])
    with pytest.raises(DataError, match=r"c\.rec: record 0 truncated"):
        RecordIOReader(tmp_path / "c.rec", tmp_path / "c.idx").read(0)


def test_insightface_round_trip(tmp_path):
    src, out = tmp_path / "faces_emore", tmp_path / "shards"
    src.mkdir()
    images = {key: jpeg(key) for key in range(1, 13)}
    # a JPEG comment segment puts the magic at a 4-aligned payload offset (32 + 8): the
    # record of key 5 must be written in two parts and joined by the reader
    images[5] = images[5][:2] + b"\xff\xfe\x00\x0aab" + MAGIC + b"cd" + images[5][2:]
    labels = {key: (key - 1) % 4 for key in images}
    payloads = {0: ir_payload((13.0, 17.0), b"")}  # images 1..12, identities 13..16
    for key, image in images.items():
        payloads[key] = (ir_payload((float(labels[key]), 0.0), image) if key % 2
                         else ir_payload(labels[key], image))
    for ident in range(13, 17):
        payloads[ident] = ir_payload((1.0, 2.0), b"")
    write_rec(src, payloads)  # no property file: classes from record 0's range
    assert encode_record(payloads[5]).count(MAGIC) == 2
    source = InsightFaceSource(src)
    assert len(source) == 12 and source.num_classes == 4
    assert main(["insightface", str(src), str(out), "--samples-per-shard", "5"]) == 0
    manifest = read_manifest(out)
    assert (manifest.num_samples, manifest.num_classes, manifest.shard_counts) == (12, 4, [5, 5, 2])
    identities = read_identities(out, manifest)  # a .rec holds labels, no names: the fallback
    assert identities.names == ("0", "1", "2", "3")
    assert identities.origin == (f"the labels of {(src / 'train.rec').resolve()} (a .rec stores "
                                 "no identity names)")
    stored = {}
    for shard in manifest.shards:
        for sample in tar_samples(out / shard.name):
            stored[int(sample["src"])] = (sample["jpg"], int(sample["cls"]), sample["__key__"])
    assert {k: (v[0], v[1]) for k, v in stored.items()} == {
        k: (images[k], labels[k]) for k in images}
    loader = make_loader(out, batch_size=4, num_workers=0, flip=False, with_keys=True)
    by_key = {key: src_key for src_key, (_, _, key) in stored.items()}
    seen = 0
    for batch_images, batch_labels, keys in loader:
        for image, label, key in zip(batch_images, batch_labels, keys, strict=True):
            original = by_key[key]
            assert int(label) == labels[original]
            decoded = np.asarray(Image.open(io.BytesIO(images[original])).convert("RGB"))
            assert np.abs(image.permute(1, 2, 0).numpy().astype(int) - decoded).max() <= 2
            seen += 1
    assert seen == 12 and loader.num_skipped == 0


def test_property_file_and_bad_label(tmp_path):
    write_rec(tmp_path, {1: ir_payload(2, jpeg(1)), 2: ir_payload(2.5, jpeg(2))}, num_classes=3)
    source = InsightFaceSource(tmp_path)
    assert source.num_classes == 3 and len(source) == 2 and source.read(0)[1] == 2
    with pytest.raises(DataError, match=r"train\.rec: record 2 has label 2\.5"):
        source.read(1)
