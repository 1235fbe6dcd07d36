"""The `kvevent` wheel as a Python user meets it: keys against the golden fingerprints, every
release's vectors against their JSON, recordings written here from the format's spec and read
back, and errors in the library's words."""

import array
import json
import pathlib
import struct
import zlib

import pytest

import kvevent

ROOT = pathlib.Path(__file__).resolve().parents[3]
TESTDATA = ROOT / "testdata"


def test_fingerprint_keys_are_the_golden_ones():
    golden = json.loads((TESTDATA / "fingerprint" / "golden.json").read_text())
    assert golden["cases"]
    for case in golden["cases"]:
        parent = case["parent_prefix"]
        keys = kvevent.fingerprint_keys(
            case["tokens"], case["block_size"], None if parent is None else int(parent)
        )
        assert keys == [int(b["prefix"]) for b in case["blocks"]], case["name"]


def test_fingerprint_keys_refuse_a_block_size_of_zero():
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        kvevent.fingerprint_keys([1, 2, 3], 0)


def test_token_ids_as_any_buffer_of_integers_give_the_same_keys():
    ids = list(range(1000, 1064))
    want = kvevent.fingerprint_keys(ids, 16)
    for given in [
        array.array("I", ids),
        array.array("q", ids),
        array.array("H", ids),
        memoryview(array.array("I", ids)),
        memoryview(array.array("I", ids).tobytes()),  # bytes: native-endian u32
        array.array("I", ids).tobytes(),
        tuple(ids),
    ]:
        assert kvevent.fingerprint_keys(given, 16) == want, type(given)
    try:
        import numpy
    except ImportError:
        pass
    else:
        for dtype in ["u4", "i8", "u8", "i4"]:
            assert kvevent.fingerprint_keys(numpy.asarray(ids, dtype), 16) == want, dtype


def test_bad_token_ids_are_refused_by_position():
    with pytest.raises(ValueError, match=r"token_ids\[1\]: True is a bool, not an id"):
        kvevent.fingerprint_keys([1, True, 3], 16)
    with pytest.raises(ValueError, match=r"token_ids\[0\]: -1 is not an id"):
        kvevent.fingerprint_keys(array.array("q", [-1, 2]), 16)
    with pytest.raises(ValueError, match=r"token_ids\[1\]: 4294967296 is not an id"):
        kvevent.fingerprint_keys(array.array("Q", [1, 2**32]), 16)
    with pytest.raises(ValueError, match='not of format "d"'):
        kvevent.fingerprint_keys(array.array("d", [1.0]), 16)
    with pytest.raises(ValueError, match="not float"):
        kvevent.fingerprint_keys(1.5, 16)


def vectors():
    for release in sorted((TESTDATA / "vectors").iterdir()):
        if not release.is_dir():
            continue
        engine = "sglang" if release.name.startswith("sglang") else "vllm"
        for payload in sorted(release.glob("*.msgpack")):
            yield engine, payload, payload.with_suffix(".json")


def test_every_release_vector_decodes_to_its_json():
    seen = 0
    for engine, payload, expected in vectors():
        got = kvevent.decode(payload.read_bytes(), engine)
        assert got == json.loads(expected.read_text()), f"{payload}"
        seen += 1
    assert seen >= 50, f"only {seen} vectors"


def test_a_bad_payload_is_a_decode_error_saying_where():
    with pytest.raises(kvevent.DecodeError, match="byte"):
        kvevent.decode(b"\x93\xcb\x00")
    assert issubclass(kvevent.DecodeError, ValueError)


def test_an_unknown_engine_is_a_value_error():
    with pytest.raises(ValueError, match="trtllm"):
        kvevent.decode(b"", "trtllm")


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def write_recording(path, engine, records):
    """The format of `kvevent-recording` (its crate docs), written independently of it."""
    header = json.dumps({"engine": engine, "started_unix_ms": 1_700_000_000_000}).encode()
    out = bytearray(b"KVEVREC" + bytes([1]) + struct.pack("<I", len(header)) + header)
    out += struct.pack("<I", zlib.crc32(header))
    last_seq, last_at, topics = {}, 0, {}
    for rank, seq, at_us, topic, replay, reset, payload in records:
        new_topic = rank not in last_seq or topics[rank] != topic
        delta = seq if rank not in last_seq else seq - last_seq[rank] - 1
        flags = (1 if new_topic else 0) | (2 if replay else 0) | (4 if reset else 0)
        body = bytearray([flags]) + varint(rank) + varint((delta << 1) ^ (delta >> 63))
        body += varint(at_us - last_at)
        if new_topic:
            body += varint(len(topic)) + topic
        if reset:
            body += varint(len(reset)) + reset.encode()
        body += payload
        out += varint(len(body)) + body + struct.pack("<I", zlib.crc32(bytes(body)))
        last_seq[rank], last_at, topics[rank] = seq, max(last_at, at_us), topic
    path.write_bytes(bytes(out))


def test_a_recording_reads_back_byte_for_byte(tmp_path):
    payloads = [p.read_bytes() for _, p, _ in vectors() if "vllm-0.33.0" in str(p)][:3]
    assert len(payloads) == 3
    path = tmp_path / "a.kvrec"
    written = [
        (0, 5, 1_000, b"kv-events", False, None, payloads[0]),
        (1, 9, 2_000, b"kv-events", True, None, payloads[1]),
        (0, 0, 3_500, b"kv-events", False, "restart", payloads[2]),
    ]
    write_recording(path, "vllm", written)
    recording = kvevent.Recording(path)
    assert (recording.engine, recording.started_unix_ms) == ("vllm", 1_700_000_000_000)
    read = [
        (r.rank, r.seq, r.at_us, r.topic, r.replay, r.reset, r.payload) for r in recording
    ]
    assert read == written
    first = next(iter(kvevent.Recording(path)))
    assert first.decode() == kvevent.decode(payloads[0])


def test_a_file_that_is_not_a_recording_is_named_in_the_error(tmp_path):
    path = tmp_path / "not.kvrec"
    path.write_bytes(b"hello, world")
    with pytest.raises(kvevent.RecordingError, match="not.kvrec: byte 0: not a kvevent recording"):
        kvevent.Recording(path)
    with pytest.raises(kvevent.RecordingError, match="missing.kvrec"):
        kvevent.Recording(tmp_path / "missing.kvrec")


def test_a_damaged_record_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "bad.kvrec"
    write_recording(path, "vllm", [(0, 1, 10, b"kv-events", False, None, b"\x93\xcb")])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a byte of the payload: its checksum no longer matches
    path.write_bytes(bytes(data))
    with pytest.raises(kvevent.RecordingError, match="bad.kvrec"):
        list(kvevent.Recording(path))
