"""The artifact file is the one artifact.json pins, before anything in it runs or is unpickled:
loading an AOTInductor package dlopens a shared library and torch.export.load unpickles, so
an artifact is code. Checked once per variant per process (variants.open_variant)."""
from __future__ import annotations

import os
import zipfile

from .errors import LoadError
from .metadata import ArtifactSpec, sha256_file


def verify_integrity(spec: ArtifactSpec, zipped: bool) -> None:
    """`zipped`: the kind's artifacts are .pt2 zip archives (checked for a zip directory)."""
    path = spec.artifact_path
    real = os.path.realpath(path)
    home = os.path.realpath(spec.variant_dir)
    if not real.startswith(home + os.sep):
        raise LoadError(f"artifact {spec.artifact!r} resolves outside the model directory ({real}); "
                        "refusing to load it")
    if not os.path.isfile(real):
        raise LoadError(f"artifact {spec.artifact!r} named in artifact.json is missing from {home}; "
                        "rebuild the archive with scripts/archive.py")
    digest = sha256_file(real)
    if digest != spec.sha256:
        raise LoadError(f"artifact {spec.artifact} has SHA-256 {digest}, but artifact.json pins "
                        f"{spec.sha256}: the file is corrupt, truncated or was replaced. Rebuild it "
                        "with scripts/compile.py and scripts/archive.py.")
    if zipped and not zipfile.is_zipfile(real):
        raise LoadError(f"artifact {spec.artifact} is not a valid .pt2 archive (zip directory not "
                        "found; truncated?). Rebuild it with scripts/compile.py.")
