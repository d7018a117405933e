"""The artifact file is the one artifact.json pins, before anything in it runs or is unpickled:
loading an AOTInductor package dlopens a shared library and torch.export.load unpickles, so
an artifact is code. Checked once for the variant a worker serves (variants.choose_variant).

What it can know: that the artifact and the artifact.json of the same archive agree. It cannot
detect an archive replaced whole (both rewritten; the .mar also carries this handler's Python):
that is cs-verify's job, against digests kept outside the archives."""
from __future__ import annotations

import os
import zipfile

from handlers.artifact import verdicts
from handlers.artifact.metadata import ArtifactSpec, sha256_file
from handlers.errors import LoadError


VERDICTS = "integrity-verdicts"


def verify_integrity(spec: ArtifactSpec, zipped: bool, verdict_root=None) -> None:
    """`zipped`: the kind's artifacts are .pt2 zip archives (checked for a zip directory).
    `verdict_root`: this user's private scratch root, where a digest that matched is kept
    (handlers/artifact/verdicts.py) against the file's identity and change time, so a restarted
    worker does not read the whole artifact again (2 GiB took seconds of every restart); any
    write to the file since, even one that restores its size and mtime, changes its ctime, which
    no user can set, and the digest is computed again (on a local filesystem; a network one may
    report cached attributes for a while). None: computed every time."""
    path = spec.artifact_path
    real = os.path.realpath(path)
    home = os.path.realpath(spec.variant_dir)
    if not real.startswith(home + os.sep):
        raise LoadError(f"artifact {spec.artifact!r} resolves outside the model directory ({real}); "
                        "refusing to load it")
    if not os.path.isfile(real):
        raise LoadError(f"artifact {spec.artifact!r} named in artifact.json is missing from {home}; "
                        "rebuild the archive with cs-archive")
    st = os.stat(real)
    key = {"artifact": real, "sha256": spec.sha256, "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
           "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}
    where = verdicts.path(key, verdict_root, VERDICTS)
    kept = verdicts.trusted(where, key)
    digest = spec.sha256 if kept else sha256_file(real)
    if digest != spec.sha256:
        # artifact.json travels in the same archive as the artifact: a mismatch shows the two
        # disagree (corruption, truncation, a partial edit), never who changed what. A replaced
        # artifact with a rewritten artifact.json passes this check; cs-verify
        # (digests kept outside the archives) is the check for replacement.
        raise LoadError(f"artifact {spec.artifact} has SHA-256 {digest}, but the artifact.json beside "
                        f"it pins {spec.sha256}: the file does not match its own archive's record "
                        "(corrupt or truncated in the archive or on disk). Rebuild it with "
                        "cs-compile and cs-archive; to detect replaced archives, check "
                        "the store with cs-verify before starting TorchServe.")
    if zipped and not zipfile.is_zipfile(real):
        raise LoadError(f"artifact {spec.artifact} is not a valid .pt2 archive (zip directory not "
                        "found; truncated?). Rebuild it with cs-compile.")
    if not kept:
        verdicts.record(where, key)
