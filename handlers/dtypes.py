"""The one dtype table: each dtype the handler accepts, under every name the data path uses.

`name` is torch's own name (artifact.json, compile.py --input); `v2` is the KServe v2
datatype; `safetensors` is the safetensors header dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Dtype:
    name: str
    torch: torch.dtype
    v2: str
    safetensors: str


TABLE = (
    Dtype("float32", torch.float32, "FP32", "F32"),
    Dtype("float16", torch.float16, "FP16", "F16"),
    Dtype("bfloat16", torch.bfloat16, "BF16", "BF16"),
    Dtype("float64", torch.float64, "FP64", "F64"),
    Dtype("int64", torch.int64, "INT64", "I64"),
    Dtype("int32", torch.int32, "INT32", "I32"),
    Dtype("int16", torch.int16, "INT16", "I16"),
    Dtype("int8", torch.int8, "INT8", "I8"),
    Dtype("uint8", torch.uint8, "UINT8", "U8"),
    Dtype("bool", torch.bool, "BOOL", "BOOL"),
)
NAMES = tuple(d.name for d in TABLE)
BY_NAME = {d.name: d for d in TABLE}
BY_TORCH = {d.torch: d for d in TABLE}
BY_V2 = {d.v2: d for d in TABLE}


def cast_hint(name: str) -> str:
    """How a client sends `name`: NumPy's cast where NumPy has the type (it has no bfloat16)."""
    return f"send {name} (numpy: .astype(np.{name}))" if name != "bfloat16" else f"send {name}"


def torch_dtype(name: str) -> torch.dtype:
    if name not in BY_NAME:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {', '.join(NAMES)}")
    return BY_NAME[name].torch


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in BY_TORCH:
        raise ValueError(f"unsupported dtype {str(dtype).replace('torch.', '')!r}; expected one of "
                         f"{', '.join(NAMES)}")
    return BY_TORCH[dtype].name
