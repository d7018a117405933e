"""The pages cite the results that exist, and the README quotes them as they are.

- Every results file the README or a docs/*.md page names (a `docs/results/...` path, a
  `results/NAME.md` link, or a set's name in a code span such as `e2e_mlp_fp16_h100_s19` or
  `frames_h200x2.*`) exists: superseded sets are removed from docs/results (git history keeps
  them), so a page citing one still quotes a superseded run.
- Every measured number in a README table row, paragraph or list item that links results files
  is a value of one of the files it links (the rule of tests/quoted_figures.py); a table row
  without a link of its own is backed by the files the paragraph just above the table links.
- A README unit quoting a throughput (req/s) links its results file or docs/performance.md.
- A results page's links to other results files (`[x](NAME.md)`) lead to files that exist.
- docs/results keeps the current sets only: at most 78 files.
- Code (docstrings, comments, messages users read) cites results files that exist, or cites
  them in git history (`git show REV:docs/results/NAME`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from quoted_figures import backed, json_numbers, quoted_numbers

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_FILES = 114  # 27 sets of three, then (s76) engine_bert_..._s76 (engine_launch late beside eager), engine_restart_mlp_..._s76 (restarts with the compiled sources) lm_qwen15b_..._s76 (the cache allocated at load, sized to the GPU) and (s77) engine_bert_..._s77 (one client and 64 with the engine's spin beside per worker) and (s78) lanes_gpu_h200_s78.json (the one-sequence decoder's lanes on the GPU, a test's counts) and (s79) lanes8_llama05b_fp16_h200_s79 (the lanes' own limit in process, one lane run to run) and engine_faults_gpu_h200x2_s79 (the GPU faults through the engine, a test's counts) and (s80) engine_mlp_..._s80, engine_r50_..._s80 and engine_bert_..._s80 (the engine loop's host cost cut; the s77 sets stay for their spin and per-worker variants, which s80 did not run) and (s81) engine_mlp_..._s81 and engine_bert_..._s81 (the workers' batch cycles beside the engine's account on the revision of stop 81, what holds issue 64's targets back; s80's stay for the loop's host cost, measured on its own revision): raise only with a set no newer run supersedes

_FENCE = re.compile(r"(?ms)^```.*?^```")
_SPAN = re.compile(r"`([^`]*)`")
# a results path as a page writes it: docs/results/NAME.EXT in prose or a link (results/NAME.EXT
# relative to docs/); a placeholder (TAG, NAME, *) is a pattern, not a citation
_PATH = re.compile(r"(?<![\w/])(?:docs/)?results/([A-Za-z0-9_.*<>-]+\.(?:json|md|png))")
# a set named by itself in a code span: NAME, NAME.*, NAME.json; a name counts when it is a path
# under results/, a set (NAME.*) or carries the device part results sets are named with (h100,
# h200x2, cpu); `key_file.json` is no results file
_STEM = re.compile(r"([a-z0-9]+(?:_[a-z0-9]+)+)(\.\*|\.json|\.md|\.png)?")
_DEVICE = re.compile(r"_(?:h1\d\d|h2\d\d(?:x\d+)?|cpu)(?:_|$)")
_LINK = re.compile(r"\]\((?:docs/)?results/([A-Za-z0-9_.-]+)\.(?:md|json|png)\)")


def _prose(text: str) -> str:
    """The page without its fenced code blocks (commands write to paths, they do not cite them)."""
    return _FENCE.sub("", text)


def cited_files(text: str) -> set:
    """Results file names (NAME.EXT) and set names (NAME) a page cites, outside commands."""
    prose = _prose(text)
    cited = set()
    for span in _SPAN.findall(prose):
        if " " in span or "=" in span:
            continue  # a command line or an assignment: it names an output, not a citation
        path = span.startswith(("docs/results/", "results/"))
        m = _STEM.fullmatch(span.removeprefix("docs/results/").removeprefix("results/"))
        if m and (path or m.group(2) == ".*" or _DEVICE.search(m.group(1))):
            cited.add(m.group(1) + (m.group(2) if m.group(2) in (".json", ".md", ".png") else ""))
    outside_spans = _SPAN.sub(" ", prose)
    for name in _PATH.findall(outside_spans):
        if not re.search(r"[*<>]|TAG|NAME", name):
            cited.add(name)
    return cited


def _exists(name: str) -> bool:
    if re.search(r"\.(json|md|png)$", name):
        return (RESULTS / name).exists()
    return any(RESULTS.glob(name + ".*"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_results_file_exists(page):
    missing = sorted(n for n in cited_files(page.read_text()) if not _exists(n))
    assert not missing, (f"{page.relative_to(ROOT)} cites results that are not in docs/results "
                         f"(removed as superseded?): cite the current set instead: {missing}")


@pytest.mark.parametrize("page", sorted(RESULTS.glob("*.md")), ids=lambda p: p.name)
def test_results_pages_link_files_that_exist(page):
    links = re.findall(r"\]\(([A-Za-z0-9_.-]+\.(?:md|json|png))\)", _prose(page.read_text()))
    missing = sorted(n for n in links if not (RESULTS / n).exists())
    assert not missing, f"{page.name} links results files that are not in docs/results: {missing}"


def units(text: str):
    """(kind, text, files it links) for each README table row, paragraph and list item."""
    blocks = re.split(r"\n\s*\n", _prose(text))
    previous_links: list = []
    for block in blocks:
        lines = block.strip("\n").splitlines()
        if lines and all(ln.startswith("|") for ln in lines):
            header = lines[0]
            for row in lines[2:]:
                own = _LINK.findall(row)
                yield "row", header + "\n" + row, own or previous_links
            previous_links = []
            continue
        items = re.split(r"(?m)^(?=- )", block)
        for item in items:
            if item.strip():
                yield "text", item, _LINK.findall(item)
        previous_links = _LINK.findall(block)


def _values(stems) -> list:
    return [v for s in stems if (RESULTS / f"{s}.json").exists()
            for v in json_numbers(json.loads((RESULTS / f"{s}.json").read_text()))]


def stale_figures(text: str) -> list:
    """(number, the files it was checked against, context) for each README figure its cited files
    do not hold."""
    bad = []
    for kind, unit, files in units(text):
        stems = sorted({f for f in files if f != "README"})
        if not stems:
            continue
        values = _values(stems)
        body = unit.split("\n", 1)[1] if kind == "row" else unit  # a header names, it does not quote
        bad += [(n, stems, ctx) for n, ctx in quoted_numbers(body) if not backed(n, values)]
    return bad


def uncited_throughputs(text: str) -> list:
    out = []
    for kind, unit, files in units(text):
        body = unit.split("\n", 1)[1] if kind == "row" else unit
        if "req/s" in unit and quoted_numbers(body) and not files and "performance.md" not in unit:
            out.append(body.strip()[:160])
    return out


def test_every_readme_figure_equals_its_results_file():
    bad = stale_figures((ROOT / "README.md").read_text())
    assert not bad, "README.md quotes figures its cited results files do not hold:\n" + "\n".join(
        f"  {n!r} (checked against {', '.join(s)}) in ...{ctx}..." for n, s, ctx in bad)


def test_every_readme_throughput_cites_its_file():
    bad = uncited_throughputs((ROOT / "README.md").read_text())
    assert not bad, "README.md quotes req/s without linking the results file (or docs/performance.md):\n" + \
        "\n".join(f"  {b}" for b in bad)


def test_results_hold_the_current_sets_only():
    files = sorted(p.name for p in RESULTS.iterdir())
    assert len(files) <= MAX_FILES, (
        f"docs/results holds {len(files)} files (at most {MAX_FILES}): `git rm` the sets a newer run "
        "superseded (git history keeps them), re-cite the current set in the docs and run "
        "`python -m bench.results_index`")


def test_the_checks_catch_a_stale_figure_and_a_missing_file():
    """The checks themselves: a figure its file does not hold, an uncited throughput and a removed
    set are found; a figure the file holds, a command's output path and a pattern are not."""
    stem = sorted(RESULTS.glob("*.json"))[0].stem
    held = next(v for v in json_numbers(json.loads((RESULTS / f"{stem}.json").read_text()))
                if v != int(v))
    absent = held + 1000.123
    page = (f"| model | req/s | file |\n|---|---|---|\n"
            f"| a | {held} | [x](docs/results/{stem}.md) |\n| b | {absent:.3f} | [x](docs/results/{stem}.md) |\n\n"
            f"It served {held} req/s ([x](docs/results/{stem}.md)).\n\n- served 12.5 req/s with no file\n")
    assert [n for n, _, _ in stale_figures(page)] == [f"{absent:.3f}"]
    assert uncited_throughputs(page) == ["- served 12.5 req/s with no file"]
    prose = (f"see `{stem}.*`, `gone_run_h100_s1`, [y](results/gone_run_h100_s2.md), `key_file.json` and "
             "`--out docs/results/e2e_x_TAG`; `docs/results/start_study_TAG.json`\n"
             "```\npython -m x --out docs/results/other_h100.json\n```\n")
    assert cited_files(prose) == {f"{stem}", "gone_run_h100_s1", "gone_run_h100_s2.md"}
    assert sorted(n for n in cited_files(prose) if not _exists(n)) == ["gone_run_h100_s1", "gone_run_h100_s2.md"]


# a results path in code (docstrings, comments, messages users read); `git show REV:PATH` cites
# history, `--out PATH` and VAR=PATH name an output, and a placeholder (TAG, NAME, *) a pattern
_CODE_PATH = re.compile(r"(?<![\w/:])docs/results/([A-Za-z0-9_.-]+\.(?:json|md|png))")


def test_code_cites_results_files_that_exist():
    import subprocess

    files = subprocess.run(["git", "ls-files", "*.py", "*.sh"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    missing = []
    for path in files:
        for n, line in enumerate((ROOT / path).read_text().splitlines(), 1):
            if "--out" in line or re.search(r"\w+=\S*docs/results/", line):
                continue
            for name in _CODE_PATH.findall(line):
                if not re.search(r"TAG|NAME", name) and not (RESULTS / name).exists():
                    missing.append(f"{path}:{n} docs/results/{name}")
    assert not missing, ("code cites results files that are not in docs/results (cite the current set, or "
                         "the file in git history as `git show REV:docs/results/NAME`):\n" + "\n".join(missing))
