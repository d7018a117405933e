#!/usr/bin/env python3
"""Rewrite the table of docs/results/README.md from the results files themselves: one row per
`.json` (what: the title of its `.md`; device and date: its own keys; committed in: the commit
that added it, from git; headline: the first row of its page's first table; links).

    python -m bench.results_index          # rewrite the table in place
    python -m bench.results_index --check  # exit 1 if the table is not what the files say
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
HEADER = ("| what | device | date | committed in | headline (first row of its table) | files |\n"
          "|---|---|---|---|---|---|\n")


def _added_in(path: Path) -> str:
    r = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h", "-1", "--", str(path)], cwd=ROOT,
                       capture_output=True, text=True)
    return r.stdout.strip() or "not yet committed"


def _headline(md: str) -> str:
    rows = [ln for ln in md.splitlines() if ln.startswith("|")]
    if len(rows) < 3:
        return ""
    head = [c.strip() for c in rows[0].strip("|").split("|")]
    first = [c.strip() for c in rows[2].strip("|").split("|")]
    return "; ".join(f"{h} {v}" for h, v in zip(head, first))[:140]


def row(path: Path) -> str:
    data = json.loads(path.read_text())
    md = path.with_suffix(".md")
    text = md.read_text() if md.exists() else ""
    title = next((ln[2:].strip() for ln in text.splitlines() if ln.startswith("# ")), path.stem)
    device = data.get("device")
    device = ", ".join(device) if isinstance(device, list) else device
    files = [f"[{ext}]({path.stem}{ext})" for ext in (".json", ".md", ".png") if path.with_suffix(ext).exists()]
    cells = [title, str(device), str(data.get("date", "")), _added_in(path), _headline(text),
             f"`{path.stem}` " + ", ".join(files)]
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |\n"


def table() -> str:
    return HEADER + "".join(row(p) for p in sorted(RESULTS.glob("*.json")))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    index = RESULTS / "README.md"
    text = index.read_text()
    new = re.sub(r"(?ms)^\| what \| device \|.*?(?=^[^|]|\Z)", lambda _m: table(), text, count=1)
    if "--check" in argv:
        return int(new != text)
    index.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
