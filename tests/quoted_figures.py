"""The number rule the results checks share: which numbers in prose are measurements, and when a
results file backs one (tests/test_evidence.py, tests/test_results_citations.py).

  - a number counts when it has a decimal point or an exponent (1.18, 0.29, 1.2e-7, 1.07x), or
    when it is an integer followed by a unit of measure (ms, s, MB, MiB, GB, %: "22 s");
  - integers without a unit are counts or names, not measurements, and are ignored: "batch 64",
    "4 workers", "120 requests", "2x H200", "ResNet-50", section numbers;
  - ignored as well: text in `code spans` (file names, commands), shapes (1x3x2160x3840), dates,
    versions (2.11.0, "TorchServe 0.12"), and thresholds, i.e. a number right after <=, <, >=,
    "target" or "tolerance" (a target is not a measurement);
  - a quoted number x with d decimals is backed when some JSON value v has round(v, d) == x;
    in exponent form (1.2e-7) when v written with the same significant digits equals x.

Derived arithmetic (a difference, a percentage of something else) is not backed by this rule:
quote the measured values themselves.
"""
from __future__ import annotations

import math
import re

UNITS = r"(?:ms|s|MB|MiB|GB|%)"
_NUM = re.compile(
    r"(?<![\w./])(?P<num>\d+(?:\.\d+)?(?:e[-+]?\d+)?)(?P<x>x)?(?:\s?(?P<unit>" + UNITS + r"))?(?![\w.])"
    r"|(?<![\w./])(?P<num2>\d+\.\d+(?:e[-+]?\d+)?)(?P<x2>x)(?=\W|$)")
_THRESHOLD = re.compile(r"(?:<=|≤|<|>=|≥|target|tolerance)\s*$", re.I)


def quoted_numbers(text: str) -> list:
    """(string as quoted, its context) for every number the rule above counts."""
    text = re.sub(r"`[^`]*`", " ", text)  # code spans
    text = re.sub(r"\b\d+(?:x\d+)+\b", " ", text)  # shapes
    text = re.sub(r"\b\d{4}-\d{2}-\d{2}\b", " ", text)  # dates
    text = re.sub(r"\b\d+\.\d+\.\d+\S*", " ", text)  # versions a.b.c
    text = re.sub(r"(?i)\b(torchserve|torch|tensorrt|torch-tensorrt|python|cuda)\s+\d+(?:\.\d+)*", " ", text)
    out = []
    for m in _NUM.finditer(text):
        num = m.group("num") or m.group("num2")
        decimal = "." in num or "e" in num
        if not decimal and not m.group("unit"):
            continue  # a count or a name
        if _THRESHOLD.search(text[max(0, m.start() - 12):m.start()]):
            continue
        out.append((num, text[max(0, m.start() - 40):m.end() + 20].replace("\n", " ")))
    return out


def json_numbers(obj) -> list:
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in json_numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in json_numbers(v)]
    return []


def backed(num: str, values) -> bool:
    x = float(num)
    if "e" in num.lower():
        mantissa = num.lower().split("e")[0]
        digits = len(mantissa.replace(".", "").lstrip("0")) or 1
        return any(v != 0 and math.isclose(float(f"{v:.{digits - 1}e}"), x) for v in values)
    d = len(num.split(".")[1]) if "." in num else 0
    return any(math.isclose(round(v, d), x, abs_tol=1e-12) for v in values)
