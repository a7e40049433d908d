"""The device piece document (`adapters.mlx.device_pieces`): what a streamed handoff's piece that
stays in GPU memory carries instead of its bytes, checked before anything is read, and the sending
buffer's region bookkeeping, and how a read region lands as the piece's arrays. The copies and the
read kernel themselves need CUDA (bench/handoff on a GPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from adapters.kv import frames
from adapters.mlx.device_pieces import (
    MAGIC,
    DevicePiece,
    Regions,
    dtype_name,
    encode,
    is_device_piece,
    landed_arrays,
    parse,
    region_bytes,
)
from adapters.mlx.device_read import Reads, read
from statecore.errors import Code, StatecoreError

FINGERPRINT = "fp-1"


def piece(**changes: object) -> DevicePiece:
    fields: dict[str, object] = dict(arena="a" * 32, handle=bytes(range(64)), offset=4096,
                                     fingerprint=FINGERPRINT, token_count=16, dtype="bfloat16",
                                     shapes=((1, 2, 16, 8),) * 4)
    fields.update(changes)
    return DevicePiece(**fields)  # type: ignore[arg-type]


def test_a_document_round_trips_with_every_byte_of_its_handle() -> None:
    sent = piece(handle=b"\x00" * 10 + bytes(range(54)))  # zero bytes inside the handle stay
    got = parse(encode(sent), fingerprint=FINGERPRINT, token_count=16, layers=2)
    assert got == sent
    assert got.nbytes() == [1 * 2 * 16 * 8 * 2] * 4


def test_kv_wire_bytes_are_not_a_device_piece() -> None:
    assert is_device_piece(encode(piece()))
    assert not is_device_piece(frames.MAGIC + b"rest of a payload")
    assert not is_device_piece(b"")


@pytest.mark.parametrize(("document", "code"), [
    (MAGIC[:-1] + b"2" + encode(piece())[len(MAGIC):], Code.KV_MALFORMED),  # another version
    (encode(piece())[:-3], Code.KV_MALFORMED),  # cut short
    (MAGIC + b"\x02\x00\x00\x00{]", Code.KV_MALFORMED),  # not JSON
    (encode(piece(fingerprint="another")), Code.KV_WRONG_MODEL),
    (encode(piece(token_count=15)), Code.KV_MALFORMED),  # not the range's tokens
    (encode(piece(shapes=((1, 2, 16, 8),) * 2)), Code.KV_MALFORMED),  # one layer, not two
    (encode(piece(shapes=((1, 2, 15, 8),) * 4)), Code.KV_MALFORMED),  # arrays of other tokens
    (encode(piece(dtype="int8")), Code.KV_MALFORMED),
    (encode(piece(handle=b"short")), Code.KV_MALFORMED),
])
def test_a_bad_document_is_refused_typed_before_anything_is_read(document: bytes, code: Code) -> None:
    with pytest.raises(StatecoreError) as raised:
        parse(document, fingerprint=FINGERPRINT, token_count=16, layers=2)
    assert raised.value.info.code is code


def test_regions_are_held_per_request_and_merge_back_when_released() -> None:
    regions = Regions(1000)
    first = regions.reserve("a", 400)
    second = regions.reserve("b", 400)
    assert (first, second) == (0, 400)
    assert regions.reserve("c", 300) is None  # 200 left
    third = regions.reserve("a", 100)
    assert third == 800 and regions.held_bytes() == 900
    regions.release("a")  # both of a's, not b's
    assert regions.held_bytes() == 400
    regions.give_back("b", 400)
    assert regions.free_runs() == [(0, 1000)]  # merged: a whole-buffer region fits again
    assert regions.reserve("d", 1000) == 0


def test_a_piece_s_dtype_is_named_as_its_document_names_it_and_others_stay_on_the_host() -> None:
    named = [dtype_name(dtype) for dtype in (mx.bfloat16, mx.float16, mx.float32, mx.int8, mx.uint16)]
    assert named == ["bfloat16", "float16", "float32", None, None]


def test_a_read_region_s_bytes_land_as_the_arrays_put_laid_out() -> None:
    """What the receiving kernel reads (the region's bytes, each array aligned in turn) comes back
    as the piece's arrays, bit for bit, in every dtype a piece carries."""
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        arrays = [mx.random.normal((1, 2, 16, 8), key=mx.random.key(seed)).astype(dtype) for seed in range(4)]
        name = dtype_name(dtype)
        assert name is not None
        sent = piece(dtype=name)
        sizes = [int(array.nbytes) for array in arrays]
        assert sent.nbytes() == sizes
        region = mx.zeros((region_bytes(sizes),), dtype=mx.uint8)
        offset = 0
        for array, size in zip(arrays, sizes, strict=True):  # laid out as `DeviceArena.put` copies them
            region[offset : offset + size] = array.reshape(-1).view(mx.uint8)
            offset += -(-size // 512) * 512
        landed = landed_arrays(region, sent)
        assert [got.dtype for got in landed] == [dtype] * 4
        assert all(got.shape == array.shape and mx.array_equal(got, array).item()
                   for got, array in zip(landed, arrays, strict=True))


def test_reads_are_settled_at_the_install_and_forgotten_on_a_cancel() -> None:
    reads = Reads()
    first, second = mx.arange(8) + 1, mx.arange(8) + 2  # unevaluated, as a kernel's read is
    reads.add("r1", first)
    reads.add("r1", second)
    reads.add("r2", mx.arange(4))
    assert len(reads) == 2
    reads.settle("r1")
    reads.forget("r2")
    assert len(reads) == 0
    reads.settle("r1")  # nothing pending: nothing to do


def test_a_device_read_is_refused_off_its_unit() -> None:
    with pytest.raises(ValueError, match="16-byte units"):
        read(4096, 100)
    with pytest.raises(ValueError, match="16-byte units"):
        read(4100, 128)
