"""The first keys of every results file (docs/results/*.json): device, date, torch, command.

`command` is the invocation that actually ran, rebuilt from sys.argv (and the environment
variables that steer it), never a literal: a results file names the command that wrote it.
When scripts/gpu_suite.sh runs a script it exports RESULTS_VIA (its own invocation), which is
recorded in front of the script's command line.
"""
from __future__ import annotations

import datetime
import os
import shlex
import sys


def invocation(argv=None, env=()) -> str:
    """The command line of this process (or `argv`, for a main(argv) called in-process), with
    the named environment variables that were set, as a shell would need them."""
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(os.path.join("pytest", "__main__.py")):
        argv[0:1] = ["-m", "pytest"]
    elif argv and os.path.basename(argv[0]) in ("pytest", "py.test"):
        argv[0:1] = ["-m", "pytest"]
    elif argv:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        a0 = os.path.abspath(argv[0])
        rel = os.path.relpath(a0, root) if a0.startswith(root + os.sep) else None
        if rel and rel.split(os.sep)[0] in ("compiled_serving", "bench", "pod") and rel.endswith(".py"):
            argv[0:1] = ["-m", rel[:-3].replace(os.sep, ".")]  # the packages run as modules
        elif rel:
            argv[0] = rel
    assigns = [f"{k}={shlex.quote(os.environ[k])}" for k in env if os.environ.get(k)]
    cmd = " ".join(assigns + ["python", shlex.join(argv)])
    via = os.environ.get("RESULTS_VIA")
    return f"{via} -> {cmd}" if via else cmd


def header(device, argv=None, env=()) -> dict:
    """{device, date, torch, command}: put first in a results dict, measured keys after."""
    import torch

    return {"device": device, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "command": invocation(argv, env)}


def page_head(report: dict, title: str, note: str = "") -> list:
    """The first lines of a results page (Markdown) from a results dict's first keys: its title,
    "Device: .. Date: .. torch .." (then `note`), and the command that wrote it."""
    line = f"Device: {report['device']}. Date: {report['date']}. torch {report['torch']}."
    return [f"# {title}", "", f"{line} {note}" if note else line, "", f"Command: `{report['command']}`", ""]


def write_pages(out, report: dict, page: str) -> None:
    """`report` (first keys from header()) as JSON into OUT as named (OUT.json by convention) and
    `page` into OUT with the suffix .md, the folder made where it is missing."""
    import json
    from pathlib import Path

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(page)


def plot_or_say(plot, report: dict, out: str, module: str) -> None:
    """plot(report, OUT.png); where matplotlib is missing (the GPU machine's Python may lack it),
    the command that plots it from OUT.json later (`module` holds `plot`: run as a script, its
    own __module__ is __main__), printed instead."""
    try:
        plot(report, out + ".png")
    except ImportError as e:
        print(f"no plot ({e}): python -c 'import json; from {module} import plot; "
              f"plot(json.load(open(\"{out}.json\")), \"{out}.png\")'")
