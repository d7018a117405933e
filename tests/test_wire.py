"""Wire formats and admission: decoding, limits, media types, response formats (in process)."""
import json

import pytest
import torch
from worker_kit import admit, make_spec

from handlers.admission import Limits
from handlers.artifact.metadata import TensorSpec
from handlers.errors import PayloadTooLarge, RequestError, UnsupportedMediaType
from handlers.wire import WireName, safetensors_io
from handlers.wire import oip_grpc as oip


def test_safetensors_roundtrip_all_dtypes():
    ts = {f"t{i}": (torch.arange(6) % 2).to(dt).reshape(2, 3) for i, dt in enumerate(
        [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool])}
    back = safetensors_io.loads(safetensors_io.dumps(ts))
    for k, v in ts.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)


def test_safetensors_dumps_strided_and_empty_tensors_and_reads_both_buffer_kinds():
    # Outputs may be views (transposed, sliced rows): their bytes must be written in logical
    # order from memory that is still alive when copied.
    g = torch.Generator().manual_seed(1)
    ts = {"t": torch.randn(3, 4, generator=g).t(), "s": torch.randn(5, 6, generator=g).half()[:, ::2],
          "e": torch.zeros(0, 3), "z": torch.tensor(2.5)}
    blob = safetensors_io.dumps(ts)
    assert isinstance(blob, bytearray)  # TorchServe sends bytearray responses without a copy
    for payload in (blob, bytes(blob)):  # TorchServe hands bodies as bytearray; clients as bytes
        back = safetensors_io.loads(payload)
        for k, v in ts.items():
            assert back[k].shape == v.shape and torch.equal(back[k], v), k


def test_safetensors_rejects_lying_offsets():
    blob = bytearray(safetensors_io.dumps({"x": torch.ones(2, 4)}))
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    header["x"]["data_offsets"] = [0, 10_000]
    h = json.dumps(header).encode()
    bad = len(h).to_bytes(8, "little") + h + bytes(blob[8 + n:])
    with pytest.raises(RequestError, match="data_offsets"):
        safetensors_io.loads(bad)
    with pytest.raises(RequestError, match="header length"):
        safetensors_io.loads((10**9).to_bytes(8, "little") + b"{}")


def limits(max_body_bytes=1 << 30, max_rows=1024, batch_max=8, split_oversized=True):
    return Limits(max_body_bytes, max_rows, batch_max, split_oversized)


def decode(request, spec, content_type=None, max_rows=1024, accept=None):
    return admit(request, spec, limits(max_rows=max_rows, batch_max=spec.batch_max), content_type, accept)


@pytest.mark.parametrize("body", [3, True, None], ids=repr)
def test_decode_json_scalar_body_is_a_400_naming_the_object_rule(body):
    with pytest.raises(RequestError, match="JSON body must be an object"):
        decode({"body": body}, make_spec(), content_type="application/json")


def test_decode_json_int_values_are_accepted_as_floats():
    d = decode({"body": {"inputs": {"x": [[1, 2, 3, 4]]}}}, make_spec())
    assert d.tensors["x"].dtype == torch.float32 and d.rows == 1


@pytest.mark.parametrize("dtype,values,bad", [
    ("int64", [[2**63, 1]], 2**63),           # numpy made floats of these
    ("int64", [[2**63, 2**63 + 5]], 2**63),   # and uint64 of these, which a cast wraps to negatives
    ("int64", [[0, -2**63 - 1]], -2**63 - 1),
    ("int64", [[1, 2**70]], 2**70),           # an object array
    ("int32", [[2**31, 0]], 2**31),           # numpy's int64, cast down to int32, wrapped
    ("uint8", [[255, 256]], 256),
])
def test_json_integers_beyond_the_inputs_dtype_are_out_of_its_range(dtype, values, bad):
    """An id of 2**63 in JSON was refused as 'got floating-point values' (numpy turns such a
    list into floats), and others wrapped silently; both now name the value and the range."""
    from dataclasses import replace

    spec = replace(make_spec(), inputs=(TensorSpec("ids", dtype, (None, 2)),))
    info = torch.iinfo(getattr(torch, dtype))
    with pytest.raises(RequestError) as e:
        decode({"body": {"inputs": {"ids": values}}}, spec)
    assert e.value.message == (f"input 'ids': {bad} is out of {dtype} range ({info.min} to {info.max}) for "
                               f"ids: {dtype}[Bx2]")
    edge = decode({"body": {"inputs": {"ids": [[info.max, info.min]]}}}, spec).tensors["ids"]
    assert edge.tolist() == [[info.max, info.min]] and edge.dtype == getattr(torch, dtype)
    with pytest.raises(RequestError, match="got floating-point values"):  # a real float is still that
        decode({"body": {"inputs": {"ids": [[1.5, 2]]}}}, spec)


def test_decode_limits_rows_per_request():
    with pytest.raises(PayloadTooLarge, match="at most 2 per request"):
        decode({"body": {"inputs": {"x": [[0.0] * 4] * 3}}}, make_spec(), max_rows=2)


def test_admission_limits_body_size_and_unsplit_rows():
    body = safetensors_io.dumps({"x": torch.ones(3, 4)})
    with pytest.raises(PayloadTooLarge, match="handler.max_body_mb") as e:
        admit({"body": body}, make_spec(), limits(max_body_bytes=len(body) - 1))
    assert e.value.status == 413
    with pytest.raises(PayloadTooLarge, match="at most 2 per call"):
        admit({"body": body}, make_spec(batch_max=2), limits(batch_max=2, split_oversized=False))
    assert admit({"body": body}, make_spec(batch_max=2), limits(batch_max=2)).rows == 3


def test_decode_media_type():
    with pytest.raises(UnsupportedMediaType) as e:
        decode({"body": b"abc"}, make_spec(), content_type="image/jpeg")
    assert e.value.status == 415
    d = decode({"body": safetensors_io.dumps({"x": torch.ones(1, 4)})}, make_spec(),
               content_type="application/octet-stream")
    assert d.wire.name == WireName.SAFETENSORS


def test_a_form_body_and_a_float64_array_are_refused_with_the_fix():
    """curl -d without a Content-Type sends a form, which TorchServe's frontend decodes into no
    parameter: a 415 naming the header to add, not "empty request". A NumPy float64 array (its
    default) for a float32 input: the cast to make."""
    with pytest.raises(UnsupportedMediaType, match="add -H 'Content-Type: application/json'") as e:
        decode({}, make_spec(), content_type="application/x-www-form-urlencoded")
    assert e.value.status == 415
    with pytest.raises(RequestError, match="empty request"):
        decode({}, make_spec())
    body = safetensors_io.dumps({"x": torch.ones(1, 4, dtype=torch.float64)})
    cast = r"send float32 \(numpy: \.astype\(np\.float32\)\)"
    with pytest.raises(RequestError, match=r"dtype float64 does not match .*" + cast):
        decode({"body": body}, make_spec(), content_type="application/x-safetensors")


def test_response_format_follows_accept():
    st = safetensors_io.dumps({"x": torch.ones(1, 4)})
    ours = {"body": {"inputs": {"x": [[1.0] * 4]}}}
    v1 = {"body": {"instances": [[1.0] * 4]}}
    assert decode({"body": st}, make_spec(), accept="application/json").respond_as.name == WireName.OURS_JSON
    assert decode({"body": st}, make_spec(), accept="*/*").respond_as.name == WireName.SAFETENSORS
    assert decode(v1, make_spec(), accept="application/json").respond_as.name == WireName.KSERVE_V1
    assert decode(ours, make_spec(), accept=safetensors_io.CONTENT_TYPE).respond_as.name == WireName.SAFETENSORS
    body, ct, _ = decode(v1, make_spec()).encode({"y": torch.ones(1, 4)}, "m")
    assert ct == "application/json" and json.loads(body) == {"predictions": [[1.0] * 4]}


def test_v2_binary_json_part_obeys_the_json_cap():
    limits = Limits(1 << 30, 1024, 8, True, max_json_bytes=1 << 10)
    header = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                     "data": [0.0] * 4}], "pad": "x" * 2048}).encode()
    with pytest.raises(PayloadTooLarge, match=r"JSON part of this v2 binary request is 2\d{3} bytes.*handler\.max_json_mb"):
        admit({"body": bytearray(header)}, make_spec(), limits, None, None, str(len(header)))


def test_oversized_oip_body_is_classified_without_parsing_and_refused_413(monkeypatch):
    class Ctx:
        def get_all_request_header(self, idx):
            return {}

    body = bytearray(b'{"id": "r", "model_name": "m", "inputs": [' + b"0," * 4096 + b"0]}")
    monkeypatch.setattr(oip.strict_json, "loads", lambda *a: pytest.fail("parsed before the cap"))
    req = {"body": body}
    from handlers.torchserve import headers

    arrived = oip.FORMAT.arrival(req, headers.read(Ctx(), 0), 1024)
    assert arrived.body is body and req == {"body": body}  # told apart unparsed; the request unchanged
    monkeypatch.undo()
    with pytest.raises(PayloadTooLarge, match="max_json_mb"):
        admit(req, make_spec(), Limits(1 << 30, 1024, 8, True, max_json_bytes=1024))


def plain_header_rule(context, idx: int, *names: str) -> list:
    """The rule the handler's header reader implements, written plainly (the handler's rule
    before it remembered spellings): a body part's header first, then the request's, names in
    any case; None where absent."""
    try:
        headers = context.get_all_request_header(idx) or {}
    except (AttributeError, IndexError, TypeError):
        return [None] * len(names)
    parts = [headers[p] for p in ("body", "data") if isinstance(headers.get(p), dict)]
    lowered = {k.lower(): v for k, v in headers.items() if isinstance(k, str) and isinstance(v, str)}
    return [next((p[n.lower()] for p in parts if p.get(n.lower())), None) or lowered.get(n.lower()) for n in names]


def test_header_reader_agrees_with_the_plain_rule_on_random_header_sets():
    """headers.read (one pass, remembered spellings) against the plain rule (body part first,
    then any-case request header) on random header dicts: the same Content-Type, Accept and v2
    header length, and `rest` exactly when a str header is there."""
    import random

    from handlers.torchserve import headers

    rng = random.Random(5)
    names = ["Content-Type", "content-type", "CONTENT-TYPE", "Accept", "accept", "Host", "User-Agent",
             "Inference-Header-Content-Length", "inference-header-content-length", "X-Trace",
             "X-Generate-Route", "x-generate-route"]
    values = ["application/json", "application/x-safetensors", "120", "", "text/plain"]

    class Ctx:
        def __init__(self, h):
            self.h = h

        def get_all_request_header(self, idx):
            return self.h

    for _ in range(3000):
        h = {n: rng.choice(values) for n in rng.sample(names, rng.randint(0, 5))}
        for part in ("body", "data"):
            if rng.random() < 0.4:
                h[part] = {k: rng.choice(values) for k in rng.sample(["content-type", "accept"], rng.randint(0, 2))}
        ctx = Ctx(h)
        got = headers.read(ctx, 0)
        want = plain_header_rule(ctx, 0, "Content-Type", "Accept", "Inference-Header-Content-Length",
                                 "X-Generate-Route")
        assert list(got[:4]) == [w or None for w in want], (h, got, want)
        assert got.rest == any(isinstance(v, str) for v in h.values()), h
    class Broken:
        def get_all_request_header(self, idx):
            raise IndexError(idx)
    assert headers.read(Broken(), 3) == headers.RequestHeaders(rest=True)


def test_every_format_is_in_the_one_list_and_the_wire_needs_no_torchserve():
    """handlers.wire.BUILT_IN is the registry: importing handlers.wire alone registers every
    format, the OIP gRPC one included, and imports nothing of TorchServe (scripts and clients
    import the package for its codecs)."""
    import subprocess
    import sys

    from conftest import ROOT

    code = ("import json, sys, handlers.wire as w; print(json.dumps([[str(getattr(n, 'value', n)) for n in w.FORMATS], "
            "list(w.TRANSPORTS), 'ts' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [["safetensors", "v2-grpc", "json", "v2", "v1"],
                               ["grpc-through-nginx", "torchserve-oip-grpc"], False]
