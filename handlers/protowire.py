"""Protocol buffers' wire format, the few pieces the Open Inference Protocol's gRPC messages need
(handlers/wire/kserve_v2_grpc.py decodes and encodes them; pod/grpc_bridge.py reads two fields
of a request and writes the small status replies). A leaf: stdlib and numpy only, no torch (the
bridge process imports it).

Facts of the encoding relied on (protobuf's "Encoding" reference, checked against the protobuf
library by tests/test_wire_grpc.py):
- A message is a sequence of fields, each a varint key `field_number << 3 | wire_type` and a
  value: wire type 0 a varint, 1 eight little-endian bytes, 2 a varint length and that many
  bytes (strings, bytes, sub-messages, packed repeated scalars), 5 four little-endian bytes.
  Groups (wire types 3, 4) are not used by proto3; field number 0 is invalid.
- A varint is 7 bits per byte, least significant group first, the high bit set on every byte
  but the last; at most 10 bytes for 64 bits (bits past the 64th are dropped, as the library
  does). int64 is the value's 64-bit two's complement; int32 negatives are sign-extended to 64
  bits too (10 bytes), and a parser keeps an int32/uint32 field's low 32 bits; bool is 0 or 1
  (a parser reads any non-zero value as true). Zigzag (sint32/sint64) is not used here.
- float and double are fixed-width little-endian IEEE 754 (4 and 8 bytes).
- Repeated scalars may arrive packed (one wire-type-2 field holding the values back to back) or
  one field per value, or both mixed; a parser takes all of them, in order. proto3 writes them
  packed. Fields may come in any order; for a singular field the last one wins, and the library
  merges repeated occurrences of a singular sub-message (their repeated fields concatenate).
- proto3 writes no field holding its default (empty string, 0, false, empty repeated field).
"""
from __future__ import annotations

import numpy as np

VARINT, I64, LEN, I32 = 0, 1, 2, 5
WIRE_NAMES = {VARINT: "varint", I64: "64-bit", LEN: "length-delimited", I32: "32-bit"}
_MASK64 = (1 << 64) - 1


class ProtoError(ValueError):
    """The bytes are not a well-formed protobuf message; the text says where."""


def read_varint(buf, pos: int) -> tuple:
    """(value as an unsigned 64-bit int, next position) of the varint at buf[pos]."""
    result = shift = 0
    end = len(buf)
    while True:
        if pos >= end:
            raise ProtoError(f"truncated varint at byte {pos} (the message ends inside it)")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result & _MASK64, pos
        shift += 7
        if shift >= 70:
            raise ProtoError(f"varint longer than 10 bytes ending at byte {pos}")


def _view(buf) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def fields(buf):
    """Yields (field number, wire type, value) of a message's top level, in order: an int for
    varints, a memoryview of `buf` (no copy) for the other wire types. Raises ProtoError at the
    first malformed field (after yielding the well-formed ones before it)."""
    view = _view(buf)
    pos, end = 0, len(view)
    while pos < end:
        start = pos
        key, pos = read_varint(view, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ProtoError(f"field number 0 at byte {start}")
        if wire == VARINT:
            value, pos = read_varint(view, pos)
        elif wire == LEN:
            n, pos = read_varint(view, pos)
            if n > end - pos:
                raise ProtoError(f"field {number} at byte {start}: length {n} runs past the end of the "
                                 f"message ({end - pos} bytes left)")
            value, pos = view[pos:pos + n], pos + n
        elif wire in (I64, I32):
            n = 8 if wire == I64 else 4
            if n > end - pos:
                raise ProtoError(f"field {number} at byte {start}: {n}-byte value truncated "
                                 f"({end - pos} bytes left)")
            value, pos = view[pos:pos + n], pos + n
        else:
            raise ProtoError(f"field {number} at byte {start}: wire type {wire} (a group) is not used by proto3")
        yield number, wire, value


def first_string(buf, number: int):
    """The top-level string field `number` as protobuf reads a singular field (its last
    occurrence), or None when absent. Only the top level is walked: other fields' length-
    delimited payloads are skipped, never parsed or copied. Raises ProtoError where the top
    level is malformed or the string is not UTF-8 (protobuf parsers refuse both)."""
    found = None
    for n, wire, value in fields(buf):
        if n == number:
            if wire != LEN:
                raise ProtoError(f"field {number} has wire type {wire} ({WIRE_NAMES.get(wire)}), expected "
                                 "2 (a length-delimited string)")
            found = value
    try:
        return None if found is None else bytes(found).decode("utf-8")
    except UnicodeDecodeError:
        raise ProtoError(f"string field {number} is not valid UTF-8") from None


def _as(values: np.ndarray, dtype) -> np.ndarray:
    """uint64 varint values as `dtype`: signed types read the 64-bit two's complement; 32-bit
    types keep the low 32 bits (as protobuf parsers do); bool is value != 0."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return values != 0
    if dtype.kind == "i":
        return values.view(np.int64).astype(dtype)
    return values.astype(dtype)


def varints(data, dtype=np.uint64) -> np.ndarray:
    """A packed run of varints as an array, vectorized: each varint ends at a byte below 0x80;
    pass k or-s every varint's k-th 7-bit group into place (at most 10 passes, each over the
    varints still that long, so memory stays a few arrays of the values' count). `dtype`: see
    _as (np.int64, np.int32, np.uint32, np.bool_...)."""
    b = np.frombuffer(data, np.uint8)
    if b.size == 0:
        return np.zeros(0, dtype)
    ends = np.flatnonzero(b < 0x80)
    if ends.size == 0 or ends[-1] != b.size - 1:
        raise ProtoError("packed varints end inside a varint (truncated)")
    if ends.size == b.size:  # every value below 128: the bytes are the values
        return _as(b.astype(np.uint64), dtype)
    starts = np.empty_like(ends)
    starts[0], starts[1:] = 0, ends[:-1] + 1
    lengths = ends - starts + 1
    longest = int(lengths.max())
    if longest > 10:
        raise ProtoError("a packed varint is longer than 10 bytes")
    values = (b[starts] & 0x7F).astype(np.uint64)
    rows, pos = slice(None), starts  # the varints longer than k bytes, and where they start
    for k in range(1, longest):
        if not (lengths[rows] > k).all():
            rows = np.flatnonzero(lengths > k)
            pos = starts[rows]
        # a 10th byte's bits past the 64th shift out of the uint64, as the library drops them
        values[rows] |= (b[pos + k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
    return _as(values, dtype)


def repeated_varints(occurrences, dtype=np.uint64) -> np.ndarray:
    """A repeated varint field from its occurrences [(wire type, value)] in order, packed
    (length-delimited runs) or one varint each, mixed as they came."""
    arrays, loose = [], []
    for wire, value in occurrences:
        if wire == VARINT:
            loose.append(value)
            continue
        if wire != LEN:
            raise ProtoError(f"a varint field arrived as wire type {wire} ({WIRE_NAMES.get(wire)})")
        if loose:
            arrays.append(_as(np.array(loose, np.uint64), dtype))
            loose = []
        arrays.append(varints(value, dtype))
    if loose:
        arrays.append(_as(np.array(loose, np.uint64), dtype))
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype)


def repeated_fixed(occurrences, dtype) -> np.ndarray:
    """A repeated float/double (fixed-width, little-endian `dtype` '<f4' / '<f8') field from its
    occurrences [(wire type, value)]: one packed run is viewed in place (np.frombuffer, no copy,
    read-only where the buffer is); several runs or single values are joined once."""
    dtype = np.dtype(dtype)
    single = I32 if dtype.itemsize == 4 else I64
    chunks = []
    for wire, value in occurrences:
        if wire not in (LEN, single):
            raise ProtoError(f"a {dtype.itemsize}-byte field arrived as wire type {wire} ({WIRE_NAMES.get(wire)})")
        if wire == LEN and len(value) % dtype.itemsize:
            raise ProtoError(f"a packed run of {dtype.itemsize}-byte values is {len(value)} bytes long, "
                             f"not a multiple of {dtype.itemsize}")
        chunks.append(value)
    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return np.frombuffer(data, dtype)


def encode_varint(value: int) -> bytes:
    """A varint; negative values as their 64-bit two's complement (10 bytes)."""
    value &= _MASK64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)



class Writer:
    """A message built field by field (in the order written). Byte payloads may be any
    C-contiguous buffer (a numpy array's memoryview): they are copied once, by bytes()."""

    def __init__(self):
        self.parts = []

    def varint(self, number: int, value: int) -> None:
        self.parts += [encode_varint(number << 3 | VARINT), encode_varint(int(value))]

    def bytes_field(self, number: int, data) -> None:
        if not isinstance(data, bytes):
            data = _view(data)
        self.parts += [encode_varint(number << 3 | LEN), encode_varint(len(data)), data]

    def string(self, number: int, text: str) -> None:
        self.bytes_field(number, text.encode("utf-8"))

    def message(self, number: int, data) -> None:
        self.bytes_field(number, data)

    def packed_varints(self, number: int, values) -> None:
        self.bytes_field(number, b"".join(encode_varint(int(v)) for v in values))

    def bytes(self) -> bytes:
        return b"".join(self.parts)


def encode_bool(number: int, value: bool) -> bytes:
    """A one-field message holding a bool (proto3 writes nothing for false)."""
    return encode_varint(number << 3 | VARINT) + b"\x01" if value else b""


def encode_string(number: int, text: str) -> bytes:
    """A one-field message holding a string."""
    w = Writer()
    w.string(number, text)
    return w.bytes()
