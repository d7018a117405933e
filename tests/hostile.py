"""Hostile request kinds for the two_input model (features: float32[Bx16], mask: bool[Bx16]),
shared by the in-process fuzz suite (tests/test_hostile.py) and the fault-injection suite
through real TorchServe (tests/test_faults.py).

Each kind: name -> (Content-Type, body bytes, expected status, a substring of the message).
Bodies are at most 300 kB except `json_over_cap`, which is just over a 1 MiB JSON limit
(archive option max_json_mb=1 in the tests that use it).
"""
from __future__ import annotations

import json
import struct

import torch

JSON = "application/json"
ST = "application/x-safetensors"
JSON_CAP_MB = 1  # handler.max_json_mb of the models these kinds are sent to


def good_tensors(n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.rand(n, 16, generator=g) > 0.3


def ours(features, mask) -> bytes:
    return json.dumps({"inputs": {"features": features, "mask": mask}}).encode()


def v2(items) -> bytes:
    return json.dumps({"inputs": items}).encode()


def st_raw(header: str, data: bytes = b"") -> bytes:
    h = header.encode()
    return struct.pack("<Q", len(h)) + h + data


def _kinds() -> dict:
    f, m = good_tensors(1)
    fl, ml = f.tolist(), m.tolist()
    row = json.dumps(fl[0])
    mask = json.dumps(ml)
    k = {
        "deep_array_50k": (JSON, b'{"inputs": {"features": ' + b"[" * 50000 + b"]" * 50000 + b"}}", 400, "nested too deeply"),
        "deep_object_50k": (JSON, b'{"a":' * 50000 + b"1" + b"}" * 50000, 400, "nested too deeply"),
        "int_5000_digits": (JSON, f'{{"inputs": {{"features": [[{"9" * 5000}]], "mask": {mask}}}}}'.encode(), 400, "too long"),
        "ints_beyond_int64": (JSON, f'{{"inputs": {{"features": [[{", ".join(["9" * 40] * 16)}]], "mask": {mask}}}}}'.encode(), 400, "features"),
        "beyond_float32": (JSON, f'{{"inputs": {{"features": [[1e39{", 0.5" * 15}]], "mask": {mask}}}}}'.encode(), 400, "non-finite"),
        "nan_token": (JSON, f'{{"inputs": {{"features": [[NaN{", 0.5" * 15}]], "mask": {mask}}}}}'.encode(), 400, "'features': holds a non-finite"),
        "infinity_token": (JSON, f'{{"inputs": {{"features": [[Infinity{", 0.5" * 15}]], "mask": {mask}}}}}'.encode(), 400, "non-finite"),
        "neg_infinity_token": (JSON, f'{{"inputs": {{"features": [[-Infinity{", 0.5" * 15}]], "mask": {mask}}}}}'.encode(), 400, "non-finite"),
        "literal_1e400": (JSON, f'{{"inputs": {{"features": [[1e400{", 0.5" * 15}]], "mask": {mask}}}}}'.encode(), 400, "non-finite"),
        "v1_nan": (JSON, f'{{"instances": [{{"features": [NaN{", 0.5" * 15}], "mask": {json.dumps(ml[0])}}}]}}'.encode(), 400, "non-finite"),
        "v2_nan": (JSON, ('{"inputs": [{"name": "features", "shape": [1, 16], "datatype": "FP32", "data": [NaN'
                          + ", 0.5" * 15 + ']}, {"name": "mask", "shape": [1, 16], "datatype": "BOOL", "data": '
                          + json.dumps(ml[0]) + "}]}").encode(), 400, "non-finite"),
        "v2_datatype_list": (JSON, v2([{"name": "features", "shape": [1, 16], "datatype": ["FP32"], "data": fl[0]}]), 400, "unknown v2 datatype"),
        "v2_datatype_dict": (JSON, v2([{"name": "features", "shape": [1, 16], "datatype": {"a": 1}, "data": fl[0]}]), 400, "unknown v2 datatype"),
        "v2_name_list": (JSON, v2([{"name": ["features"], "shape": [1, 16], "datatype": "FP32", "data": fl[0]}]), 400, "name must be a string"),
        "v2_shape_huge": (JSON, v2([{"name": "features", "shape": [10**15, 16], "datatype": "FP32", "data": fl[0]},
                                    {"name": "mask", "shape": [1, 16], "datatype": "BOOL", "data": ml[0]}]), 400, "needs"),
        "v2_shape_negative": (JSON, v2([{"name": "features", "shape": [-1, 16], "datatype": "FP32", "data": fl[0]}]), 400, "non-negative"),
        "v2_data_dict": (JSON, v2([{"name": "features", "shape": [1, 16], "datatype": "FP32", "data": {"x": 1}},
                                   {"name": "mask", "shape": [1, 16], "datatype": "BOOL", "data": ml[0]}]), 400, "features"),
        "v2_many_inputs": (JSON, v2([{"name": "features", "shape": [1, 16], "datatype": "FP32", "data": fl[0]}] * 500), 400, "inputs; the artifact takes 2"),
        "scalar_number": (JSON, b"3", 400, "JSON body must be an object"),
        "scalar_true": (JSON, b"true", 400, "JSON body must be an object"),
        "scalar_null": (JSON, b"null", 400, "JSON body must be an object"),
        "string_body": (JSON, b'"inputs"', 400, "JSON body must be an object"),
        "not_utf8": (JSON, b'{"inputs": "\xff\xfe"}', 400, "not UTF-8"),
        "empty_body": (JSON, b"", 400, "empty JSON body"),
        "truncated_json": (JSON, ours(fl, ml)[:-7], 400, "malformed JSON"),
        "v1_instances_object": (JSON, b'{"instances": {"features": 1}}', 400, "non-empty list"),
        "ours_inputs_string": (JSON, b'{"inputs": {"features": "abc", "mask": "def"}}', 400, "nested list"),
        "ragged_rows": (JSON, f'{{"inputs": {{"features": [{row}, [1.0]], "mask": {mask}}}}}'.encode(), 400, "rectangular"),
        "strings_in_array": (JSON, ours([["a"] * 16], ml), 400, "features"),
        "rank_70": (JSON, b'{"inputs": {"features": ' + b"[" * 70 + b"1" + b"]" * 70 + b', "mask": ' + mask.encode() + b"}}", 400, "features"),
        "bool_as_numbers": (JSON, ours(fl, [[2] * 16]), 400, "expected bool"),
        "rows_1025": (JSON, ours([[0.0] * 16] * 1025, [[True] * 16] * 1025), 413, "at most 1024 per request"),
        "json_over_cap": (JSON, b'{"inputs": {"features": [[' + b"0.0, " * (JSON_CAP_MB * 1024 * 1024 // 5 + 10) + b'0.0]]}}', 413, "application/x-safetensors"),
        "st_deep_header": (ST, st_raw('{"a":' * 5000 + "1" + "}" * 5000), 400, "safetensors header"),
        "st_int_5000_digits": (ST, st_raw('{"features": {"dtype": "F32", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 4]}}', b"\0" * 8), 400, "safetensors header"),
        "st_dtype_list": (ST, st_raw('{"features": {"dtype": ["F32"], "shape": [1, 16], "data_offsets": [0, 64]}}', b"\0" * 64), 400, "malformed"),
        "st_dtype_dict": (ST, st_raw('{"features": {"dtype": {"F32": 1}, "shape": [1, 16], "data_offsets": [0, 64]}}', b"\0" * 64), 400, "malformed"),
        "st_shape_inf": (ST, st_raw('{"features": {"dtype": "F32", "shape": [1e400, 16], "data_offsets": [0, 64]}}', b"\0" * 64), 400, "malformed"),
        "st_shape_nan": (ST, st_raw('{"features": {"dtype": "F32", "shape": [NaN, 16], "data_offsets": [0, 64]}}', b"\0" * 64), 400, "malformed"),
        "st_entry_not_object": (ST, st_raw('{"features": [1, 2, 3]}'), 400, "malformed"),
        "st_huge_shape": (ST, st_raw('{"features": {"dtype": "F32", "shape": [1000000000, 1000000000], "data_offsets": [0, 64]}}', b"\0" * 64), 400, "data_offsets"),
        "st_lying_offsets": (ST, st_raw('{"features": {"dtype": "F32", "shape": [1, 16], "data_offsets": [0, 100000]}}', b"\0" * 64), 400, "data_offsets"),
        "st_rank_100": (ST, st_raw('{"features": {"dtype": "F32", "shape": [' + ", ".join(["1"] * 100) + '], "data_offsets": [0, 4]}}', b"\0" * 8), 400, "dimensions"),
        "st_header_length_lies": (ST, struct.pack("<Q", 10**12) + b"{}", 400, "header length"),
        "unsupported_media": ("image/png", b"\x89PNG\r\n", 415, "not supported"),
    }
    return k


KINDS = _kinds()


def good_request(seed: int):
    """(Content-Type, body, features, mask): a valid request of 1-3 rows, JSON or binary."""
    from handlers.wire import safetensors_io

    f, m = good_tensors(1 + seed % 3, seed)
    if seed % 2:
        return ST, bytes(safetensors_io.dumps({"features": f, "mask": m})), f, m
    return JSON, ours(f.tolist(), m.tolist()), f, m
