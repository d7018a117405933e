"""The bytes of weights an artifact puts on its GPU: what every worker holds a copy of, read from the
artifact's own files without loading (dlopen-ing or unpickling) anything.

  python -m compiled_serving.weight_bytes ARTIFACT_DIR [...]   # prints each artifact's bytes and how they were read

Per kind (artifact.json "backend"):
- aoti (AOTInductor package): the constants table the package's wrapper.cpp compiles in (one
  `constants_info_[i].data_size = N;` per constant: the sizes the loaded model reports through
  AOTInductorModelContainerGetConstantDataSize); without the source, the constants blob of its .so.
- aoti_so (bare AOTInductor library): the constants blob linked into the .so, between the ELF symbols
  `_binary_constants_bin_start` and `_binary_constants_bin_end` (AOTInductor links the weights in as
  a binary object; on a test package both spans equal the wrapper.cpp table exactly).
- export (torch.export.save): the tensor files of the archive (`data/weights/*`, `data/constants/*`,
  older torch's `serialized_state_dict.pt` / `serialized_constants.pt`), configuration JSON excluded,
  and the KV cache a slot-form program leaves out for the loader to allocate (artifact.json's
  `extra.cache`; a package's constants table lists its cache, left out too, with the weights).
- tensorrt and anything unread: the file's size, an upper bound (engines and code included).
"""
from __future__ import annotations

import mmap
import os
import re
import shutil
import struct
import sys
import tempfile
import zipfile
from dataclasses import dataclass

CONSTANT_SIZE = re.compile(rb"constants_info_\[\d+\]\.data_size = (\d+);")
BLOB_START, BLOB_END = b"_binary_constants_bin_start", b"_binary_constants_bin_end"
EXPORT_TENSORS = ("/data/weights/", "/data/constants/")
EXPORT_LEGACY = ("serialized_state_dict.pt", "serialized_constants.pt")


@dataclass(frozen=True)
class WeightBytes:
    bytes: int
    how: str  # where the number comes from, for the archive's printed arithmetic
    upper_bound: bool = False

    @property
    def mib(self) -> float:
        return self.bytes / 2**20


def elf_constants_blob(f) -> int | None:
    """Bytes between AOTInductor's constants-blob symbols in an ELF64 little-endian file `f` (an
    open binary file), or None where the file is not such an ELF or has no such symbols (stripped).
    ELF64 layout: e_shoff at 0x28, e_shentsize/e_shnum at 0x3A; a section header's sh_type at +4,
    sh_offset at +0x18, sh_size at +0x20, sh_link at +0x28; a symbol is 24 bytes (st_name u32,
    st_info, st_other, st_shndx u16, st_value u64, st_size u64)."""
    try:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (ValueError, OSError):
        return None
    with m:
        if m[:6] != b"\x7fELF\x02\x01":
            return None
        shoff, = struct.unpack_from("<Q", m, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", m, 0x3A)

        def section(i):
            base = shoff + i * shentsize
            kind, = struct.unpack_from("<I", m, base + 4)
            offset, size = struct.unpack_from("<QQ", m, base + 0x18)
            link, = struct.unpack_from("<I", m, base + 0x28)
            return kind, offset, size, link

        found = {}
        for i in range(shnum):
            kind, offset, size, link = section(i)
            if kind != 2:  # SHT_SYMTAB
                continue
            _, str_off, _, _ = section(link)
            for s in range(offset, offset + size, 24):
                name_at, = struct.unpack_from("<I", m, s)
                start = str_off + name_at
                name = m[start:m.find(b"\0", start)]
                if name in (BLOB_START, BLOB_END):
                    found[name] = struct.unpack_from("<Q", m, s + 8)[0]
        if len(found) != 2:
            return None
        return found[BLOB_END] - found[BLOB_START]


def _aoti_package(path: str) -> WeightBytes | None:
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if info.filename.endswith(".wrapper.cpp"):
                sizes = CONSTANT_SIZE.findall(z.read(info.filename))
                return WeightBytes(sum(int(n) for n in sizes),
                                   f"{len(sizes)} constants in the AOTInductor package's constants table")
        for info in z.infolist():
            if info.filename.endswith(".so"):
                # mmap needs a file: the member, copied out
                with z.open(info.filename) as src, tempfile.TemporaryFile() as f:
                    shutil.copyfileobj(src, f, 16 << 20)
                    f.flush()
                    n = elf_constants_blob(f)
                if n is not None:
                    return WeightBytes(n, "the constants blob of the AOTInductor package's .so")
    return None


def _aoti_so(path: str) -> WeightBytes | None:
    with open(path, "rb") as f:
        n = elf_constants_blob(f)
    return None if n is None else WeightBytes(n, "the constants blob linked into the AOTInductor library")


def _exported_program(path: str) -> WeightBytes | None:
    with zipfile.ZipFile(path) as z:
        tensors = [i for i in z.infolist() if not i.filename.endswith(".json")
                   and (any(d in i.filename for d in EXPORT_TENSORS) or i.filename.endswith(EXPORT_LEGACY))]
    if not tensors:
        return None
    return WeightBytes(sum(i.file_size for i in tensors), f"{len(tensors)} tensor files of the exported program")


READERS = {"aoti": _aoti_package, "aoti_so": _aoti_so, "export": _exported_program}


def with_cache(found: WeightBytes, spec) -> WeightBytes:
    """`found` and, for an exported program, the KV cache it leaves out and the loader allocates
    (artifact.json's extra.cache: handlers/artifact/cache.py); a package's constants table already
    lists the cache with its weights."""
    from handlers.artifact import cache
    from handlers.errors import LoadError

    try:
        extra = cache.nbytes(spec) if spec.backend == "export" else 0
    except LoadError as e:
        raise SystemExit(f"weight_bytes: error: {e}") from e
    if not extra:
        return found
    return WeightBytes(found.bytes + extra, f"{found.how} and the {extra / 2**20:.1f} MiB cache allocated at load "
                       "(artifact.json extra.cache)", found.upper_bound)


def weight_bytes(spec) -> WeightBytes:
    """The weights of the artifact `spec` (an ArtifactSpec) describes, with how they were read."""
    path = spec.artifact_path
    reader = READERS.get(spec.backend)
    try:
        found = reader(path) if reader else None
    except (zipfile.BadZipFile, OSError, struct.error) as e:
        raise SystemExit(f"weight_bytes: error: cannot read the weights of {path}: {e}") from e
    if found is not None:
        return with_cache(found, spec)
    why = ("engines and code included" if spec.backend == "tensorrt"
           else f"its {spec.backend} weights could not be read apart")
    return WeightBytes(os.path.getsize(path), f"the size of {os.path.basename(path)}, an upper bound ({why})",
                       upper_bound=True)


def main(argv=None):
    from handlers.artifact.metadata import read_spec

    for d in (sys.argv[1:] if argv is None else argv):
        w = weight_bytes(read_spec(d))
        print(f"{d}: {w.bytes} bytes ({w.mib:.1f} MiB): {w.how}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
