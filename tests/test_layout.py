"""The repository's rooms by role (docs/architecture.md, "Layout"): the handler package a .mar
carries (`handlers/`), the build side (`compiled_serving/`, installed with console commands), the
KServe pod's runtime (`pod/`), benchmarks and studies (`bench/`), the shell entry points
(`scripts/`). Imports go down the rooms only and form no cycle; no function outside the tests is
over 60 lines; the layout table names every file's room; every console command runs its module."""
import ast
import re
import subprocess
import tomllib

from conftest import ROOT

# what each room may import (besides itself, the standard library and installed packages)
MAY_IMPORT = {
    "handlers": set(),
    "compiled_serving": {"handlers"},
    "pod": {"handlers", "compiled_serving"},  # compiled_serving: local_pod's local TorchServe only
    "examples": set(),
    "bench": {"handlers", "compiled_serving", "pod", "examples"},
}
POD_RUNTIME_MAY_IMPORT = {"handlers"}  # what the image carries: pod/ without local_pod, handlers/
MAX_FUNCTION_LINES = 60


def tracked(pattern="*.py"):
    out = subprocess.run(["git", "ls-files", pattern], cwd=ROOT, capture_output=True, text=True, check=True)
    return [p for p in out.stdout.split() if (ROOT / p).exists()]


def module_name(path: str) -> str:
    parts = path[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def code_modules() -> dict:
    """{module name: path} of every Python file outside the tests."""
    return {module_name(p): p for p in tracked() if p.split("/")[0] in MAY_IMPORT}


def imports_of(path: str, modules: dict) -> set:
    """The project's modules that `path` imports (at module level or inside functions)."""
    tree = ast.parse((ROOT / path).read_text())
    here = module_name(path)
    package = here if path.endswith("__init__.py") else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from PKG import MODULE` reaches MODULE (its package's __init__ runs first, as for
            # any submodule, which is no edge); `from PKG import NAME` reaches PKG
            names = [f"{base}.{a.name}" for a in node.names]
            if not all(n in modules for n in names):
                names.append(base)
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != here:
                found.add(name)
    return found


def test_imports_go_down_the_rooms_only():
    modules = code_modules()
    assert {"compiled_serving.archive", "bench.bench_e2e", "pod.start", "handlers.ts_entry"} <= set(modules)
    bad = []
    for mod, path in modules.items():
        room = mod.split(".")[0]
        allowed = POD_RUNTIME_MAY_IMPORT if room == "pod" and mod != "pod.local_pod" else MAY_IMPORT[room]
        for dep in imports_of(path, modules):
            if dep.split(".")[0] not in allowed | {room}:
                bad.append(f"{path} imports {dep}")
    assert not bad, "imports back up the rooms:\n" + "\n".join(bad)


# The GPU side of issue 64 (handlers/engine/, the engine process and the worker's client of it)
# runs handlers' runners and errors, never TorchServe's adapter (test_engine_core.py also checks
# what the engine process imports at run time).
ENGINE_MAY_NOT_IMPORT = ("handlers.torchserve", "handlers.ts_entry", "handlers.worker", "handlers.pipeline")


def test_the_engine_package_imports_nothing_of_torchserve():
    modules = code_modules()
    bad = [f"{path} imports {dep}" for mod, path in modules.items() if mod == "handlers.engine" or mod.startswith("handlers.engine.")
           for dep in imports_of(path, modules) if dep.startswith(ENGINE_MAY_NOT_IMPORT)]
    assert not bad, "the engine imports TorchServe's side:\n" + "\n".join(bad)


def imported_names(path: str) -> set:
    """Every absolute module name `path` imports, at module level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            names.add(node.args[0].value)
    return names


def test_prefork_imports_nothing_of_handlers_and_the_engine_nothing_of_ts():
    """compiled_serving/prefork.py runs in every starting worker and in the zygote, where the
    archive's `handlers` comes first on PYTHONPATH and a forked worker must import that copy
    itself: it imports nothing of `handlers` (PREIMPORTS included). The engine process
    (handlers/engine/) runs without TorchServe: nothing of `ts`."""
    from compiled_serving import prefork

    def under(name, pkg):
        return name == pkg or name.startswith(pkg + ".")

    bad = [f"compiled_serving/prefork.py imports {n}" for n in imported_names("compiled_serving/prefork.py")
           | set(prefork.PREIMPORTS) if under(n, "handlers")]
    bad += [f"{path} imports {n}" for path in tracked("handlers/engine/*.py") for n in imported_names(path)
            if under(n, "ts")]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    modules = code_modules()
    graph = {m: imports_of(p, modules) for m, p in modules.items()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_function_over_60_lines_outside_the_tests():
    long = []
    for path in tracked():
        if path.startswith("tests/"):
            continue
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(long)


def layout_table() -> dict:
    """{path cell: what} of docs/architecture.md's layout table."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = re.search(r"(?ms)^## Layout\n.*?^\| path \| what \|\n\|---\|---\|\n(.*?)(?:\n\n|\Z)", text)
    assert table, "docs/architecture.md has no layout table"
    rows = {}
    for line in table.group(1).splitlines():
        cell, what = line.strip("|").split("|", 1)
        rows[cell.strip()] = what
    return rows


def test_the_layout_table_names_every_files_room():
    rows = layout_table()
    cells = " ".join(rows)
    top = {p.split("/")[0] + ("/" if "/" in p else "") for p in tracked("*")}
    missing = sorted(t for t in top if f"`{t}" not in cells and not t.startswith("."))
    assert not missing, f"docs/architecture.md's layout table has no row for {missing}"
    # every module and script of the rooms by role is named in its room's rows
    unnamed = []
    for room in ("compiled_serving", "bench", "pod", "scripts", "handlers/engine"):
        text = " ".join(c + what for c, what in rows.items() if f"`{room}/" in c)
        for path in tracked(f"{room}/*"):
            stem = path.rsplit("/", 1)[1]
            stem = stem[:-3] if stem.endswith(".py") else stem
            if stem != "__init__" and not re.search(rf"\b{re.escape(stem)}\b", text):
                unnamed.append(path)
    assert not unnamed, f"docs/architecture.md's layout table does not name {unnamed}"


def test_every_console_command_runs_its_module():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    commands = project["project"]["scripts"]
    assert commands and all(c.startswith("cs-") for c in commands)
    modules = code_modules()
    for command, target in commands.items():
        module, func = target.split(":")
        assert module in modules and module.startswith("compiled_serving."), (command, target)
        source = (ROOT / modules[module]).read_text()
        assert f"def {func}(argv=None)" in source, (command, target)
        assert 'if __name__ == "__main__":' in source, f"{module} does not run as python -m {module}"


def test_a_workers_own_copy_of_handlers_comes_before_the_installed_one(tmp_path):
    """The environment holds `handlers` (installed editable with the build package), yet a TorchServe
    worker must run the copy its archive carries: the frontend puts the model's directory on the
    worker's PYTHONPATH. A stand-in copy on PYTHONPATH is the one imported; without it, the
    checkout's, from any directory (what the console commands rely on)."""
    import os
    import sys

    stand_in = tmp_path / "handlers"
    stand_in.mkdir()
    (stand_in / "__init__.py").write_text("")
    where = [sys.executable, "-c", "import handlers; print(handlers.__file__)"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = subprocess.run(where, cwd="/", env={**env, "PYTHONPATH": str(tmp_path)},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert got == str(stand_in / "__init__.py")
    got = subprocess.run(where, cwd="/", env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert got == str(ROOT / "handlers" / "__init__.py")
