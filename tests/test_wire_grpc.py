"""The Open Inference Protocol's gRPC messages as a REST body (handlers/wire/kserve_v2_grpc.py, on
handlers/protowire.py) against the reference, the protobuf library, in both directions: requests
the library builds and serializes decode to exactly the tensors the library's message holds (raw
and typed contents, packed and unpacked, negative integers, NaN bit patterns); replies we encode
parse with the library to our tensors; protowire's varint decoder and writer agree with the
library. Then every client error is a 400 naming what was wrong, arbitrary and mutated bytes are
only ever 400s, and one request through a real TorchServe.

The messages come from tests/data/oip_infer.proto (the protocol's field list, package
`inference`), compiled by grpc_tools.protoc into a temporary directory.
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, eager
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from worker_kit import admit

from handlers import protowire
from handlers.admission import Limits
from handlers.artifact.metadata import ArtifactSpec, TensorSpec
from handlers.dtypes import BY_NAME, BY_V2
from handlers.errors import RequestError
from handlers.protowire import I32, I64, LEN, VARINT, ProtoError
from handlers.wire import kserve_v2_grpc as grpc_wire
from handlers.wire.base import Parsed
from handlers.wire.kserve_v2_grpc import MEDIA

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    """The protobuf library's classes for tests/data/oip_infer.proto."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("oip_pb")
    data = ROOT / "tests" / "data"
    assert protoc.main(["protoc", f"-I{data}", f"--python_out={out}", str(data / "oip_infer.proto")]) == 0
    spec = importlib.util.spec_from_file_location("oip_infer_pb2", out / "oip_infer_pb2.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["oip_infer_pb2"] = module
    spec.loader.exec_module(module)
    return module


def make_spec(inputs, outputs=(("y", "float32"),)) -> ArtifactSpec:
    """An artifact taking `inputs` [(name, dtype)] (shapes are admission's business, not decode's)."""
    return ArtifactSpec(backend="export", artifact="model.pt2", sha256="", device="cpu",
                        inputs=tuple(TensorSpec(n, d, (None, 4)) for n, d in inputs),
                        outputs=tuple(TensorSpec(n, d, (None, 4)) for n, d in outputs),
                        output_structure="dict", batch_min=1, batch_max=8, torch_version=torch.__version__)


def decode(body, spec):
    """(tensors, the request's id or None), as wire.read and admission read them."""
    parsed = grpc_wire.FORMAT.parse(body)
    return grpc_wire.FORMAT.decode(parsed, spec), parsed.request_id


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal dtype, shape and values, NaN where NaN (payload bits may change through the library's
    Python floats), every other float bit for bit (signed zeros too)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if not want.dtype.is_floating_point:
        return torch.equal(got, want)
    nan = torch.isnan(want)
    if not torch.equal(torch.isnan(got), nan):
        return False
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
    return torch.equal(got[~nan].view(bits), want[~nan].view(bits))


# ---------------------------------------------------------------- requests: library -> our decoder

RAW_NP = {"FP32": np.float32, "FP16": np.float16, "BF16": np.int16, "FP64": np.float64, "INT64": np.int64,
          "INT32": np.int32, "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8, "BOOL": np.uint8}
TYPED = {"FP32": ("fp32_contents", np.float32), "FP64": ("fp64_contents", np.float64),
         "INT64": ("int64_contents", np.int64), "INT32": ("int_contents", np.int32),
         "INT16": ("int_contents", np.int16), "INT8": ("int_contents", np.int8),
         "UINT8": ("uint_contents", np.uint8), "BOOL": ("bool_contents", np.bool_)}
DATATYPES = ["FP32", "FP16", "BF16", "INT64", "INT32", "BOOL", "FP64", "INT16", "INT8", "UINT8"]


def values_for(datatype: str, n: int):
    """n values of a datatype as the library's typed field takes them."""
    if datatype == "BOOL":
        return st.lists(st.booleans(), min_size=n, max_size=n)
    if datatype == "FP32":
        return st.lists(st.floats(width=32), min_size=n, max_size=n)
    if datatype in ("FP16", "BF16"):  # typed: FP32 values, rounded to the half type by build()
        # no NaN: kserve_v2.narrow compares with torch.equal, so it refuses NaN as inexact
        return st.lists(st.floats(width=32, allow_nan=False), min_size=n, max_size=n)
    if datatype == "FP64":
        return st.lists(st.floats(), min_size=n, max_size=n)
    info = np.iinfo(RAW_NP[datatype])
    return st.lists(st.integers(int(info.min), int(info.max)), min_size=n, max_size=n)


@st.composite
def requests(draw):
    """(serialized ModelInferRequest, spec): 1-3 inputs of random datatypes and shapes, raw or
    typed contents, sometimes requested outputs, sometimes re-encoded unpacked."""
    raw = draw(st.booleans())
    count = draw(st.integers(1, 3))
    inputs = []
    for i in range(count):
        dt = draw(st.sampled_from(DATATYPES))
        shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
        n = math.prod(shape)
        if raw and dt == "BOOL":
            data = bytes(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
        elif raw:
            size = n * np.dtype(RAW_NP[dt]).itemsize
            data = draw(st.binary(min_size=size, max_size=size))
        else:
            data = draw(values_for(dt, n))
        inputs.append((f"in{i}", dt, shape, data))
    wanted = draw(st.lists(st.sampled_from(["y", "z"]), unique=True, max_size=2))
    return raw, inputs, wanted, draw(st.text(max_size=8)), draw(st.sampled_from(["packed", "unpacked", "mixed"]))


def build(pb, raw, inputs, wanted, rid):
    """The library's message, and the artifact's dtype of each input (FP16/BF16 typed inputs go
    as FP32 values rounded to the half type first: the portable way, converted when exact)."""
    msg = pb.ModelInferRequest(model_name="m", model_version="1", id=rid)
    dtypes = []
    for name, dt, shape, data in inputs:
        dtypes.append((name, BY_V2[dt].name))
        sent = "FP32" if not raw and dt in ("FP16", "BF16") else dt
        t = msg.inputs.add(name=name, datatype=sent, shape=shape)
        if raw:
            msg.raw_input_contents.append(data)
            continue
        if dt in ("FP16", "BF16"):
            data = torch.tensor(data, dtype=torch.float32).to(BY_V2[dt].torch).float().tolist()
        getattr(t.contents, TYPED[sent][0]).extend(data)
    for w in wanted:
        msg.outputs.add(name=w)
    return msg, dtypes


def held(msg, i: int, artifact_dtype: str) -> torch.Tensor:
    """Input i as the library's parsed message holds it, as a tensor of the artifact's dtype."""
    t = msg.inputs[i]
    shape = list(t.shape)
    if msg.raw_input_contents:
        a = np.frombuffer(msg.raw_input_contents[i], RAW_NP[t.datatype]).copy()
        out = torch.from_numpy(a)
        out = out.view(torch.bfloat16) if t.datatype == "BF16" else out.bool() if t.datatype == "BOOL" else out
        return out.reshape(shape)
    field, np_dtype = TYPED[t.datatype]
    out = torch.from_numpy(np.array(list(getattr(t.contents, field)), dtype=np_dtype).reshape(-1))
    return out.to(BY_NAME[artifact_dtype].torch).reshape(shape)  # FP32 -> half: exact by construction


def rewrite(buf, how: str, depth: int = 0) -> bytes:
    """The same message with every packed scalar run re-encoded one value per field ("unpacked"),
    or its first half so and the rest packed ("mixed"); nested inputs (5) and contents (5) too."""
    w = protowire.Writer()
    for number, wire, value in protowire.fields(buf):
        nested = (depth, number) in ((0, 5), (1, 5))
        scalar = (depth == 2 and number in range(1, 8)) or (depth == 1 and number == 3)
        if wire == LEN and nested:
            w.message(number, rewrite(value, how, depth + 1))
        elif wire == LEN and scalar and how != "packed":
            _unpack(w, number, value, how)
        elif wire == VARINT:
            w.varint(number, value)
        else:
            w.bytes_field(number, value)
    return w.bytes()


def _unpack(w, number: int, value, how: str) -> None:
    size = {6: 4, 7: 8}.get(number)  # fp32/fp64 contents: fixed width; the rest varints
    items = ([bytes(value[k:k + size]) for k in range(0, len(value), size)] if size
             else protowire.varints(value).tolist())
    cut = len(items) // 2 if how == "mixed" else 0
    if cut:
        if size:
            w.bytes_field(number, b"".join(items[:cut]))
        else:
            w.packed_varints(number, items[:cut])
    for item in items[cut:]:
        if size:
            w.parts += [protowire.encode_varint(number << 3 | (I32 if size == 4 else I64)), item]
        else:
            w.varint(number, item)


def test_rewrite_really_unpacks(pb):
    """The unpacked re-encoding is what the test means: one field per value, the library agrees."""
    c = pb.InferTensorContents(int64_contents=[1, -2, 3], fp32_contents=[1.5, 2.5])
    msg = pb.ModelInferRequest(inputs=[pb.ModelInferRequest.InferInputTensor(name="a", shape=[3], contents=c)])
    back = rewrite(msg.SerializeToString(), "unpacked")
    assert back != msg.SerializeToString() and pb.ModelInferRequest.FromString(back) == msg
    tensor = next(v for n, _, v in protowire.fields(back) if n == 5)
    contents = next(v for n, _, v in protowire.fields(tensor) if n == 5)
    assert [(n, w) for n, w, _ in protowire.fields(contents)] == [(3, VARINT)] * 3 + [(6, I32)] * 2


@given(requests())
@SETTINGS
def test_decoder_gives_exactly_what_the_library_holds(pb, drawn):
    raw, inputs, wanted, rid, how = drawn
    msg, dtypes = build(pb, raw, inputs, wanted, rid)
    body = rewrite(msg.SerializeToString(), how)
    parsed = pb.ModelInferRequest.FromString(body)  # the reference's reading of the same bytes
    spec = make_spec(dtypes, (("y", "float32"), ("z", "int64")))
    tensors, got_id = decode(body, spec)
    assert list(tensors) == [t.name for t in parsed.inputs]
    for i, (name, dtype) in enumerate(dtypes):
        want = held(parsed, i, dtype)
        assert same(tensors[name], want), (name, dtype, tensors[name], want)
    assert got_id == (parsed.id or None)
    ours = grpc_wire.FORMAT.parse(body)
    assert ours.wanted == tuple((o.name, None) for o in parsed.outputs)
    assert ours.names == (parsed.model_name, parsed.model_version)


def test_typed_fp32_is_a_view_of_the_body_not_a_copy(pb):
    msg = pb.ModelInferRequest(inputs=[pb.ModelInferRequest.InferInputTensor(
        name="x", datatype="FP32", shape=[2, 4], contents=pb.InferTensorContents(fp32_contents=range(8)))])
    body = bytearray(msg.SerializeToString())  # TorchServe hands bodies over as bytearray
    t = decode(body, make_spec([("x", "float32")]))[0]["x"]
    base = np.frombuffer(body, np.uint8).ctypes.data
    assert base <= t.data_ptr() < base + len(body)
    assert t.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_merged_contents_messages_concatenate_like_the_library(pb):
    """A singular sub-message sent twice merges (its repeated fields concatenate)."""
    t = protowire.Writer()
    t.string(1, "n")
    t.string(2, "INT64")
    t.packed_varints(3, [1, 4])
    for part in ([1, -2], [3, 2**40]):
        c = protowire.Writer()
        c.packed_varints(3, part)
        t.message(5, c.bytes())
    w = protowire.Writer()
    w.message(5, t.bytes())
    body = w.bytes()
    want = list(pb.ModelInferRequest.FromString(body).inputs[0].contents.int64_contents)
    assert want == [1, -2, 3, 2**40]
    assert decode(body, make_spec([("n", "int64")]))[0]["n"].tolist() == [want]


# ---------------------------------------------------------------- replies: our encoder -> library

OUT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
              torch.int16, torch.int8, torch.uint8, torch.bool]


@st.composite
def outputs(draw):
    out = {}
    for i in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(OUT_DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        data = bytearray(draw(st.binary(min_size=n, max_size=n)))
        t = torch.frombuffer(data, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        t = (t & 1).bool() if dtype == torch.bool else t.view(dtype)
        out[f"out{i}"] = t.reshape(shape)
    return out


def library_outputs(resp) -> dict:
    """A reply's outputs as tensors, read the way tritonclient does (raw_output_contents[i])."""
    assert len(resp.raw_output_contents) == len(resp.outputs)
    out = {}
    for o, raw in zip(resp.outputs, resp.raw_output_contents):
        assert not o.HasField("contents")
        a = torch.from_numpy(np.frombuffer(raw, RAW_NP[o.datatype]).copy())
        a = a.view(torch.bfloat16) if o.datatype == "BF16" else a.bool() if o.datatype == "BOOL" else a
        out[o.name] = a.reshape(list(o.shape))
    return out


@given(outputs(), st.text(max_size=10), st.text(max_size=10), st.text(max_size=10))
@SETTINGS
def test_encoder_replies_parse_with_the_library(pb, outs, rid, name, version):
    enc = grpc_wire.FORMAT.encode(outs, Parsed(None, rid or None), name, version)
    assert enc.media_type == MEDIA and enc.headers == {}
    resp = pb.ModelInferResponse.FromString(enc.body)
    assert (resp.model_name, resp.model_version, resp.id) == (name, version, rid)
    got = library_outputs(resp)
    assert list(got) == list(outs)  # the model's order
    for k, t in outs.items():
        assert same(got[k], t), k
        assert [o.datatype for o in resp.outputs if o.name == k] == [BY_NAME[str(t.dtype)[6:]].v2]


def test_reply_holds_the_requested_outputs_in_their_order(pb):
    msg = pb.ModelInferRequest(inputs=[pb.ModelInferRequest.InferInputTensor(
        name="x", datatype="FP32", shape=[1, 4], contents=pb.InferTensorContents(fp32_contents=[1, 2, 3, 4]))])
    msg.outputs.add(name="z")
    msg.outputs.add(name="y")
    body = msg.SerializeToString()
    parsed = grpc_wire.FORMAT.parse(body)
    grpc_wire.FORMAT.decode(parsed, make_spec([("x", "float32")], (("y", "float32"), ("z", "int64"))))
    outs = {"y": torch.ones(1, 4), "z": torch.tensor([[-7]])}
    resp = pb.ModelInferResponse.FromString(grpc_wire.FORMAT.encode(outs, parsed, "m", "").body)
    assert [o.name for o in resp.outputs] == ["z", "y"]
    got = library_outputs(resp)
    assert got["z"].tolist() == [[-7]] and got["y"].tolist() == [[1.0] * 4]


def test_strided_outputs_are_written_in_logical_order(pb):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    resp = pb.ModelInferResponse.FromString(grpc_wire.FORMAT.encode({"t": t}, Parsed(None), "m").body)
    assert torch.equal(library_outputs(resp)["t"], t)


# ---------------------------------------------------------------- protowire against the library

INT_FIELDS = {"int64_contents": np.int64, "int_contents": np.int32, "uint64_contents": np.uint64,
              "uint_contents": np.uint32, "bool_contents": np.bool_}


def packed_run(buf) -> memoryview:
    runs = [v for _, w, v in protowire.fields(buf) if w == LEN]
    assert len(runs) == 1
    return runs[0]


@given(st.sampled_from(sorted(INT_FIELDS)), st.data())
@SETTINGS
def test_varints_decode_what_the_library_encodes(pb, field, data):
    dtype = np.dtype(INT_FIELDS[field])
    elems = st.booleans() if dtype == np.bool_ else st.integers(int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))
    values = data.draw(st.lists(elems, min_size=1, max_size=200))
    buf = pb.InferTensorContents(**{field: values}).SerializeToString()
    got = protowire.varints(packed_run(buf), dtype)
    assert got.dtype == dtype and got.tolist() == values


@given(st.lists(st.integers(-(2**63), 2**64 - 1), max_size=50))
@SETTINGS
def test_writer_varints_parse_with_the_library(pb, values):
    """encode_varint / packed_varints against the library: int64 keeps two's complement, uint64
    reads the same bits unsigned, an int32 field keeps the low 32 bits."""
    w = protowire.Writer()
    for number in (2, 3, 5):
        w.packed_varints(number, values)
    c = pb.InferTensorContents.FromString(w.bytes())
    bits = [v & (2**64 - 1) for v in values]
    assert list(c.uint64_contents) == bits
    assert list(c.int64_contents) == [b - 2**64 if b >= 2**63 else b for b in bits]
    assert list(c.int_contents) == [(b & 0xFFFFFFFF) - 2**32 if b & 0x80000000 else b & 0xFFFFFFFF for b in bits]


@given(st.text(), st.text(), st.binary(max_size=300))
@SETTINGS
def test_first_string_reads_what_the_library_reads(pb, name, rid, raw):
    msg = pb.ModelInferRequest(model_name=name, id=rid, raw_input_contents=[raw, raw])
    msg.inputs.add(name="not me", datatype="FP32", shape=[2**40, -1])
    body = msg.SerializeToString()
    assert protowire.first_string(body, 1) == (name or None)
    assert protowire.first_string(body, 3) == (rid or None)
    assert protowire.first_string(body + protowire.encode_string(1, "last"), 1) == "last"  # the last one wins


def test_first_string_refuses_malformed_bytes():
    body = protowire.encode_string(1, "two") + protowire.encode_string(7, "x" * 100)
    for bad, match in [(body[:-1], "runs past the end"), (b"\x0a\x01\xff", "UTF-8"),
                       (b"\x08\x01", "wire type 0"), (b"\x0a\x05ab\x80", "runs past"),
                       (b"\x38\x80", "truncated varint")]:
        with pytest.raises(ProtoError, match=match):
            protowire.first_string(bad, 1)
    assert protowire.first_string(body, 2) is None and protowire.first_string(b"", 1) is None


def test_read_varint_edges():
    assert protowire.read_varint(b"\xff" * 9 + b"\x01", 0) == (2**64 - 1, 10)
    assert protowire.read_varint(b"\xff" * 9 + b"\x7f", 0) == (2**64 - 1, 10)  # bits past 64 dropped, as upb
    with pytest.raises(ProtoError, match="longer than 10 bytes"):
        protowire.read_varint(b"\xff" * 10 + b"\x01", 0)
    with pytest.raises(ProtoError, match="end inside a varint"):
        protowire.varints(b"\x01\x80")
    with pytest.raises(ProtoError, match="longer than 10 bytes"):
        protowire.varints(b"\xff" * 10 + b"\x01")


def test_protowire_is_a_leaf():
    """The bridge process imports it without torch: stdlib and numpy only."""
    import ast

    tree = ast.parse((ROOT / "handlers" / "protowire.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "numpy"} | set(sys.stdlib_module_names), imported


def test_a_broken_varint_decoder_is_caught(pb, monkeypatch):
    """The comparison above fails when the decoder is wrong: sign extension dropped."""
    monkeypatch.setattr(protowire, "_as", lambda v, d: v.astype(np.uint32).astype(d))
    buf = pb.InferTensorContents(int64_contents=[-5, 2**40]).SerializeToString()
    assert protowire.varints(packed_run(buf), np.int64).tolist() != [-5, 2**40]


# ---------------------------------------------------------------- client errors: 400, named

SPEC = make_spec([("x", "float32"), ("h", "float16"), ("m", "bool"), ("k", "int8"), ("n", "int64")],
                 (("y", "float32"), ("z", "int64")))


def request(pb, *inputs, raws=None, outputs=()):
    """inputs: (name, datatype, shape, contents kwargs or None)."""
    msg = pb.ModelInferRequest(model_name="m")
    for name, dt, shape, contents in inputs:
        t = msg.inputs.add(name=name, datatype=dt, shape=shape)
        if contents is not None:
            t.contents.CopyFrom(pb.InferTensorContents(**contents))
    msg.raw_input_contents.extend(raws or [])
    for o in outputs:
        msg.outputs.add(name=o)
    return msg.SerializeToString()


def x4(**contents):
    return ("x", "FP32", [1, 4], contents or {"fp32_contents": [1, 2, 3, 4]})


def tail_field(number: int, payload: bytes) -> bytes:
    return protowire.encode_varint(number << 3 | LEN) + protowire.encode_varint(len(payload)) + payload


ERRORS = {
    "unknown input": (lambda pb: request(pb, ("nope", "FP32", [1, 4], {"fp32_contents": [1] * 4})),
                      ["unknown input 'nope'", "x: float32"]),
    "datatype mismatch": (lambda pb: request(pb, ("x", "INT64", [1, 4], {"int64_contents": [1] * 4})),
                          ["input 'x'", "datatype INT64 does not match the artifact's FP32"]),
    "unknown datatype": (lambda pb: request(pb, ("x", "BYTES", [1], {"bytes_contents": [b"a"]})),
                         ["unknown v2 datatype 'BYTES'", "expected FP32"]),
    "FP32 for fp16 not exact": (lambda pb: request(pb, ("h", "FP32", [1, 4], {"fp32_contents": [0.1] * 4})),
                                ["input 'h'", "not exactly representable as float16"]),
    "typed count vs shape": (lambda pb: request(pb, ("x", "FP32", [2, 4], {"fp32_contents": [1] * 4})),
                             ["input 'x'", "shape [2, 4] needs 8 values", "fp32_contents holds 4"]),
    "raw size vs shape": (lambda pb: request(pb, ("x", "FP32", [1, 4], None), raws=[b"\0" * 12]),
                          ["input 'x'", "raw_input_contents[0] is 12 bytes", "FP32 needs 16"]),
    "BOOL raw not 0/1": (lambda pb: request(pb, ("m", "BOOL", [1, 4], None), raws=[b"\0\1\2\0"]),
                         ["input 'm'", "must be 0 or 1", "found 2"]),
    "wrong typed field": (lambda pb: request(pb, ("x", "FP32", [1, 4], {"int64_contents": [1] * 4})),
                          ["input 'x'", "FP32 takes its values in fp32_contents (InferTensorContents field 6)",
                           "has int64_contents"]),
    "FP16 typed": (lambda pb: request(pb, ("h", "FP16", [1, 4], {"fp32_contents": [1] * 4})),
                   ["input 'h'", "FP16 has no typed contents field", "raw_input_contents"]),
    "raw and typed mixed": (lambda pb: request(pb, x4(), ("m", "BOOL", [1, 4], None), raws=[b"\0" * 16, b"\0" * 4]),
                            ["input 'x' carries typed contents (fp32_contents)", "raw_input_contents"]),
    "raw count": (lambda pb: request(pb, ("x", "FP32", [1, 4], None), ("m", "BOOL", [1, 4], None),
                                     raws=[b"\0" * 16]),
                  ["1 raw_input_contents for 2 inputs", "one per input"]),
    "no contents": (lambda pb: request(pb, ("x", "FP32", [1, 4], None)),
                    ["input 'x'", "needs 4 values; no contents and the request has no raw_input_contents"]),
    "INT8 out of range": (lambda pb: request(pb, ("k", "INT8", [1, 2], {"int_contents": [5, 300]})),
                          ["input 'k'", "INT8 values must lie in -128..127", "5..300"]),
    "negative shape": (lambda pb: request(pb, ("x", "FP32", [-1, 4], {"fp32_contents": [1] * 4})),
                       ["input 'x'", "shape must be a list of non-negative integers", "-1"]),
    "too many inputs": (lambda pb: request(pb, *[x4()] * 6), ["6 inputs", "the artifact takes 5"]),
    "input twice": (lambda pb: request(pb, x4(), x4()), ["input 'x' appears more than once"]),
    "unknown output": (lambda pb: request(pb, x4(), outputs=["z", "nope"]),
                       ["unknown output(s) 'nope'", "returns y, z"]),
    "output twice": (lambda pb: request(pb, x4(), outputs=["y", "y"]), ["'y' requested more than once"]),
    "truncated varint": (lambda pb: request(pb, x4()) + b"\x38",
                         ["malformed ModelInferRequest", "truncated varint", "inference.ModelInferRequest"]),
    "length past the end": (lambda pb: request(pb, x4())[:-3],
                            ["malformed ModelInferRequest", "runs past the end"]),
    "inner length past the end": (
        lambda pb: tail_field(5, b"\x0a\x01x" + b"\x2a\x05\x32\x10\0\0\x80"),
        ["malformed ModelInferRequest.inputs[0].contents", "runs past the end"]),
    "packed fp32 not whole": (lambda pb: tail_field(5, b"\x0a\x01x\x12\x04FP32\x1a\x01\x01\x2a\x05\x32\x03\0\0\x80"),
                              ["inputs[0].contents.fp32_contents", "3 bytes long, not a multiple of 4"]),
    "inputs as a varint": (lambda pb: b"\x28\x01", ["field 5 (inputs) of ModelInferRequest has wire type 0"]),
    "name not UTF-8": (lambda pb: tail_field(5, b"\x0a\x02\xff\xfe"), ["inputs[0].name is not valid UTF-8"]),
    "a group": (lambda pb: b"\x0b", ["wire type 3"]),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_client_errors_are_400s_naming_the_fault(pb, case):
    make, parts = ERRORS[case]
    with pytest.raises(RequestError) as e:
        decode(make(pb), SPEC)
    assert type(e.value) is RequestError and e.value.status == 400
    for p in parts:
        assert p in e.value.message, (case, e.value.message)


def test_exact_fp32_values_are_accepted_for_half_inputs(pb):
    body = request(pb, ("h", "FP32", [1, 4], {"fp32_contents": [0.5, -2, 65504, 0]}))
    t = decode(body, SPEC)[0]["h"]
    assert t.dtype == torch.float16 and t.tolist() == [[0.5, -2, 65504, 0]]


def test_a_str_body_is_refused():
    with pytest.raises(RequestError, match="must arrive as bytes"):
        decode("\x0a\x01m", SPEC)


# ---------------------------------------------------------------- admission: media type, fuzz

def limits():
    return Limits(1 << 30, 1024, 8, True)


def test_admission_chooses_it_by_media_type_and_answers_in_it(pb):
    f, m = torch.randn(2, 4), torch.rand(2, 4) > 0.5
    body = request(pb, ("x", "FP32", [2, 4], None), ("m", "BOOL", [2, 4], None),
                   raws=[f.numpy().tobytes(), m.numpy().tobytes()])
    spec = make_spec([("x", "float32"), ("m", "bool")])
    a = admit({"body": bytearray(body)}, spec, limits(), f"{MEDIA}; charset=binary")
    assert a.wire.name == "v2-grpc" and a.respond_as is a.wire and a.rows == 2
    assert torch.equal(a.tensors["x"], f) and torch.equal(a.tensors["m"], m)
    enc = a.encode({"y": f * 2}, "two", "1")
    resp = pb.ModelInferResponse.FromString(enc.body)
    assert enc.media_type == MEDIA and (resp.model_name, resp.model_version) == ("two", "1")
    assert torch.equal(library_outputs(resp)["y"], f * 2)
    # any other request may ask for a protobuf reply; a protobuf request for JSON
    j = admit({"body": b'{"inputs": {"x": [[1, 2, 3, 4]], "m": [[true, true, false, true]]}}'}, spec, limits(),
              "application/json", MEDIA)
    assert j.respond_as.media_type == MEDIA and j.encode({"y": torch.ones(1, 4)}, "two").media_type == MEDIA
    assert admit({"body": body}, spec, limits(), MEDIA, "application/json").respond_as.media_type == "application/json"
    # the outputs a KServe v2 JSON request asks for are the ones a protobuf reply holds, with its id
    two = make_spec([("x", "float32"), ("m", "bool")], (("y", "float32"), ("z", "int64")))
    v2 = json.dumps({"id": "r9", "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
                                            {"name": "m", "shape": [1, 4], "datatype": "BOOL",
                                             "data": [True, False, True, True]}],
                     "outputs": [{"name": "z"}]}).encode()
    k = admit({"body": v2}, two, limits(), "application/json", MEDIA)
    resp = pb.ModelInferResponse.FromString(k.encode({"y": torch.ones(1, 4), "z": torch.tensor([[5]])}, "two").body)
    assert [o.name for o in resp.outputs] == ["z"] and resp.id == "r9"
    assert library_outputs(resp)["z"].tolist() == [[5]]


def test_admission_refuses_a_contract_violation_after_decoding(pb):
    body = request(pb, ("x", "FP32", [1, 3], {"fp32_contents": [1, 2, 3]}))
    with pytest.raises(RequestError, match="dimension 1"):
        admit({"body": body}, make_spec([("x", "float32")]), limits(), MEDIA)


def admit_or_400(body):
    try:
        admit({"body": body}, SPEC, limits(), MEDIA)
    except RequestError as e:
        assert e.status in (400, 413), e


@given(st.binary(max_size=300))
@SETTINGS
def test_arbitrary_bytes_are_only_ever_400s(blob):
    admit_or_400(blob)


@given(st.integers(0, 10**6), st.integers(0, 255), st.booleans())
@SETTINGS
def test_mutated_valid_requests_are_only_ever_400s(pb, position, byte, cut):
    body = bytearray(request(pb, x4(), ("k", "INT8", [1, 4], {"int_contents": [-1, 2, -3, 4]}),
                             ("n", "INT64", [1, 4], {"int64_contents": [-(2**40), 1, 2, 3]}), outputs=["z"]))
    if cut:
        del body[position % len(body):]
    else:
        body[position % len(body)] = byte
    admit_or_400(bytes(body))


# ---------------------------------------------------------------- through a real TorchServe


@pytest.mark.server
def test_real_torchserve_answers_a_model_infer_request(main_server, pb):
    """Raw and typed contents, requested outputs and the id through TorchServe's REST path, equal
    to eager; a bad request gets the usual JSON error with 400."""
    g = torch.Generator().manual_seed(21)
    f, m = torch.randn(3, 16, generator=g), torch.rand(3, 16, generator=g) > 0.3
    ref = eager("two_input", f, m)
    raw = request(pb, ("features", "FP32", [3, 16], None), ("mask", "BOOL", [3, 16], None),
                  raws=[f.numpy().tobytes(), m.numpy().tobytes()])
    typed = pb.ModelInferRequest.FromString(request(
        pb, ("features", "FP32", [3, 16], {"fp32_contents": f.flatten().tolist()}),
        ("mask", "BOOL", [3, 16], {"bool_contents": m.flatten().tolist()}), outputs=["probs"]))
    typed.id = "req-7"
    for body, names, rid in ((raw, ["score", "probs"], ""), (typed.SerializeToString(), ["probs"], "req-7")):
        r = main_server.predict("two_export", body, content_type=MEDIA)
        assert r.status_code == 200, r.text
        assert r.headers["Content-Type"].startswith(MEDIA)
        resp = pb.ModelInferResponse.FromString(r.content)
        assert (resp.model_name, resp.id) == ("two_export", rid)
        got = library_outputs(resp)
        assert list(got) == names
        for k in names:
            assert got[k].shape == ref[k].shape and (got[k] - ref[k]).abs().max().item() < 1e-4, k
    wrong_field = request(pb, ("features", "FP32", [3, 16], {"int64_contents": [1] * 48}),
                          ("mask", "BOOL", [3, 16], None))
    bad = main_server.predict("two_export", wrong_field, content_type=MEDIA)
    assert bad.status_code == 400, bad.text
    err = bad.json()
    assert err["code"] == 400 and "fp32_contents" in err["message"] and "int64_contents" in err["message"]


# ---------------------------------------------------------------------------------------------
# The same message as a gRPC call's own body (handlers/wire/grpc_framed.py, the pod's nginx)


def framed(message: bytes, flag: int = 0) -> bytes:
    return bytes([flag]) + len(message).to_bytes(4, "big") + message


def test_a_grpc_framed_call_decodes_like_the_message_and_answers_framed(pb):
    from handlers.torchserve.headers import RequestHeaders
    from handlers.wire import arrival, grpc_framed

    spec = make_spec([("x", "float32")])
    msg = pb.ModelInferRequest(model_name="m", id="r7")
    msg.inputs.add(name="x", datatype="FP32", shape=[2, 4])
    msg.raw_input_contents.append(np.arange(8, dtype="<f4").tobytes())
    body = framed(msg.SerializeToString())
    headers = RequestHeaders(content_type="application/grpc")
    fmt = arrival({"body": body}, headers, 1 << 20).errors_as
    assert fmt is grpc_framed.FORMAT  # chosen by the Content-Type alone, before the body
    assert arrival({"body": body}, RequestHeaders(content_type="application/json"), 1 << 20).errors_as.transport is None
    parsed = fmt.parse(body)
    tensors = fmt.decode(parsed, spec)
    assert parsed.request_id == "r7" and torch.equal(tensors["x"], torch.arange(8, dtype=torch.float32).reshape(2, 4))
    out = fmt.encode({"y": torch.ones(2, 4)}, parsed, "m", "1")
    assert out.media_type == "application/grpc" and out.body[0] == 0
    assert int.from_bytes(out.body[1:5], "big") == len(out.body) - 5
    reply = pb.ModelInferResponse.FromString(out.body[5:])
    assert reply.model_name == "m" and reply.id == "r7" and list(reply.outputs[0].shape) == [2, 4]


def test_grpc_framing_errors_and_another_model(pb):
    from handlers.errors import ModelNotFound
    from handlers.wire import grpc_framed

    msg = pb.ModelInferRequest(model_name="other")
    msg.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    msg.raw_input_contents.append(np.zeros(4, "<f4").tobytes())
    good = msg.SerializeToString()
    for body, words in ((framed(good, flag=1), "compressed"), (framed(good)[:-1], "prefix says"),
                        (b"\0\0", "5-byte")):
        with pytest.raises(RequestError, match=words):
            grpc_framed.FORMAT.parse(body)
    parsed = grpc_framed.FORMAT.parse(framed(good))
    grpc_framed.FORMAT.decode(parsed, make_spec([("x", "float32")]))
    with pytest.raises(ModelNotFound, match="'other'"):  # never answered by the model this worker serves
        grpc_framed.FORMAT.encode({"y": torch.ones(1, 4)}, parsed, "m")
    err = grpc_framed.FORMAT.error(RequestError("input 'x': 100% wrong\nline two"), None, "m")
    assert err.body == b"" and err.media_type == "application/grpc"
    assert err.headers["X-Grpc-Message"] == "input 'x': 100%25 wrong%0Aline two"
