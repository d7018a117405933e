"""Read one of TorchServe's logs whole, across its rollovers.

The shipped log4j2.xml (like TorchServe's own) rolls each log at midnight and at 100 MB: the
current file starts empty and what was written before goes to `<stem>.<YYYY-MM-DD>-<N>.log.gz`
beside it (TorchServe's own file names it `<stem>.<dd-MMM>.log.gz`). log4j2 renames to the
uncompressed name first and compresses after, so for a moment the same part can exist in both
forms. A reader of only `model_log.log` loses the worker's load lines when a run crosses
midnight (seen: a CI run that crossed midnight failed three checks of the load lines)."""
from __future__ import annotations

import gzip
from pathlib import Path


def _rolled_parts(path: Path) -> list[Path]:
    """The rolled parts of `path`, oldest first; one file per part (the uncompressed name
    while log4j2 is still compressing it)."""
    parts: dict[str, Path] = {}
    for p in path.parent.glob(f"{path.stem}.*{path.suffix}*"):
        if p == path:
            continue
        key = p.name[: -len(".gz")] if p.name.endswith(".gz") else p.name
        if key not in parts or not p.name.endswith(".gz"):
            parts[key] = p
    return sorted(parts.values(), key=_mtime)


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:  # removed since the glob (log4j2's compression, or its Delete): read as oldest
        return 0.0


def _read_part(p: Path) -> str:
    try:
        data = gzip.decompress(p.read_bytes()) if p.name.endswith(".gz") else p.read_bytes()
    except (EOFError, OSError):  # a .gz still being written, or gone between glob and read
        return ""
    return data.decode(errors="replace")


def read_log(path: Path) -> str:
    """The text of the log at `path`, its rolled parts first, "" where none exists."""
    path = Path(path)
    text = "".join(_read_part(p) for p in _rolled_parts(path))
    return text + (path.read_text(errors="replace") if path.exists() else "")
