"""Verdicts a worker keeps for the next start: a check that passed once (the trial load, the
artifact's SHA-256) is not run again while what it depends on is unchanged. Each verdict is a
file holding exactly the facts it was reached on, in this user's private scratch root
(handlers/torchserve/scratch.py: a directory no one else may write), trusted only as a regular
file of this user that no one else may write."""
from __future__ import annotations

import hashlib
import json
import os
import stat


def path(key: dict, root, kind: str):
    """Where the verdict on `key` is kept under `root` (None: nowhere, so never trusted)."""
    if root is None:
        return None
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return os.path.join(root, kind, name + ".ok")


def trusted(where, key: dict) -> bool:
    """A regular file of this user that no one else may write, holding exactly `key`."""
    if where is None:
        return False
    try:
        st = os.lstat(where)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return False
        with open(where) as f:
            return json.load(f) == key
    except (OSError, ValueError):
        return False


def record(where, key: dict) -> None:
    """Keeps the verdict on `key` (atomically); one not kept costs the next start the check."""
    if where is None:
        return
    try:
        os.makedirs(os.path.dirname(where), mode=0o700, exist_ok=True)
        tmp = f"{where}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(key, f)
        os.replace(tmp, where)
    except OSError:
        pass
