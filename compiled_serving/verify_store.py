#!/usr/bin/env python3
"""Verify a model store's .mar archives against a digest list the operator keeps outside them.

  python -m compiled_serving.verify_store record --store model_store --digests /etc/models/digests.sha256
  python -m compiled_serving.verify_store check  --store model_store --digests /etc/models/digests.sha256

Why: the SHA-256 in artifact.json lives inside the same archive, so it catches corruption and
truncation, not replacement: whoever can rewrite a .mar can rewrite artifact.json with it, and a
.mar also carries the handler's own Python, which the worker imports. Only a digest of the whole
archive, kept where archive writers cannot write, tells that the store holds what was built.
Run `check` before `torchserve --start` (or before copying a store to KServe storage:
`python -m compiled_serving.kserve --digests FILE`).

The list is `sha256sum` format ("HEX  NAME.mar" per line), so `cd STORE && sha256sum -c FILE`
checks it too. `check` fails (exit 1) for an archive whose digest differs, an archive the list
does not name (TorchServe would serve it too) and a listed archive that is missing.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys


def sha256(path: str) -> str:
    # hashlib itself (not handlers.artifact.metadata.sha256_file): this check runs before any server
    # starts and needs no torch import
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def archives(store: str) -> list:
    return sorted(n for n in os.listdir(store) if n.endswith(".mar"))


def read_digests(path: str) -> dict:
    out = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split(None, 1)
            if len(parts) != 2 or len(parts[0]) != 64:
                raise SystemExit(f"verify_store: {path}:{n}: expected 'SHA256  NAME.mar', got {line!r}")
            out[parts[1].lstrip("*")] = parts[0].lower()
    return out


def problems(store: str, digests: dict) -> list:
    found = archives(store)
    out = [f"{n}: missing from {store} (listed in the digest list)" for n in sorted(set(digests) - set(found))]
    for n in found:
        if n not in digests:
            out.append(f"{n}: not in the digest list; TorchServe could serve it. Record it once you trust it")
        elif sha256(os.path.join(store, n)) != digests[n]:
            out.append(f"{n}: SHA-256 differs from the digest list: the archive was changed after it was "
                       "recorded (rebuilt, corrupted or replaced). Do not serve it until you know which")
    return out


def warn_if_inside(store: str, digests_path: str) -> None:
    if os.path.realpath(digests_path).startswith(os.path.realpath(store) + os.sep):
        print(f"verify_store: warning: {digests_path} is inside the store; keep it where archive "
              "writers cannot write", file=sys.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("record", "check"))
    p.add_argument("--store", default="model_store")
    p.add_argument("--digests", required=True)
    args = p.parse_args(argv)
    if not os.path.isdir(args.store):
        raise SystemExit(f"verify_store: {args.store} is not a directory")
    warn_if_inside(args.store, args.digests)
    if args.action == "record":
        names = archives(args.store)
        with open(args.digests, "w") as f:
            f.writelines(f"{sha256(os.path.join(args.store, n))}  {n}\n" for n in names)
        print(f"recorded {len(names)} archive(s) of {args.store} in {args.digests}")
        return 0
    bad = problems(args.store, read_digests(args.digests))
    for line in bad:
        print(f"verify_store: {line}", file=sys.stderr)
    if not bad:
        print(f"{len(archives(args.store))} archive(s) of {args.store} match {args.digests}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
