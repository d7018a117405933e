"""The artifact-kind registry: one module per kind, one line per kind below.

A kind's name is the `backend` value in artifact.json. Kinds are tried in this order when an
artifact's own files are recognised (kinds.recognise)."""
from __future__ import annotations

from handlers.artifact.kinds import aoti_package, aoti_so, exported_program, tensorrt
from handlers.artifact.kinds.base import ArtifactKind, LoadedModel  # noqa: F401  (the interface, for kind modules)
from handlers.errors import LoadError

KINDS = {}


def register(kind: ArtifactKind) -> ArtifactKind:
    KINDS[kind.name] = kind
    return kind


register(aoti_package.KIND)
register(aoti_so.KIND)
register(exported_program.KIND)
register(tensorrt.KIND)


def kind_of(spec_or_name) -> ArtifactKind:
    name = getattr(spec_or_name, "backend", spec_or_name)
    try:
        return KINDS[name]
    except KeyError:
        raise LoadError(f"unknown backend {name!r} in artifact.json; expected one of "
                        f"{', '.join(KINDS)}") from None


def recognise(spec):
    """`spec` as its files say it is: a kind that claims the files takes it over, then the
    kind refines the build facts from its own files."""
    for kind in KINDS.values():
        if kind.name != spec.backend and kind.claims(spec):
            spec = kind.adopt(spec)
            break
    return kind_of(spec).refine(spec)
