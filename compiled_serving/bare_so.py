"""The compile side of the bare AOTInductor shared library kind (handlers/artifact/kinds/aoti_so.py):
extract a package's wrapper library (and its cubins) as an `aoti_so` variant, the format
before `.pt2` packages."""
from __future__ import annotations

import os
import shutil
import zipfile

from handlers.artifact.kinds.aoti_so import KIND as AOTI_SO
from handlers.artifact.metadata import ArtifactSpec, sha256_file, write_spec
from handlers.errors import LoadError


def extract_bare_so(spec: ArtifactSpec, dest: str) -> ArtifactSpec:
    os.makedirs(os.path.join(dest, "cubin"), exist_ok=True)
    so_name = None
    with zipfile.ZipFile(spec.artifact_path) as z:
        for name in z.namelist():
            base = os.path.basename(name)
            if name.endswith(".wrapper.so") or (name.endswith(".so") and "aotinductor" in name and so_name is None):
                with z.open(name) as src, open(os.path.join(dest, "model.so"), "wb") as out:
                    shutil.copyfileobj(src, out)
                so_name = base
            elif name.endswith(".cubin"):
                with z.open(name) as src, open(os.path.join(dest, "cubin", base), "wb") as out:
                    shutil.copyfileobj(src, out)
    if so_name is None:
        raise LoadError(f"{spec.artifact} holds no AOTInductor shared library to extract")
    so_path = os.path.join(dest, "model.so")
    bare = ArtifactSpec(**{**spec.__dict__, "backend": AOTI_SO.name, "artifact": "model.so",
                           "sha256": sha256_file(so_path), "extra": {**spec.extra, "cubin_dir": "cubin"},
                           "variant_dir": dest})
    write_spec(bare, dest)
    return bare
