"""Every claim backed: the results files and the README's "Results" section.

Results files (docs/results/*.json) are written whole by the command recorded in them
(bench/results_meta.header): their first keys are device, date, torch, command, in that
order, and the Markdown beside each one quotes that same command.

README numbers. Every *measured* number quoted in a "## Results" section of README.md or of a
docs/*.md page (up to the next "## " heading, subsections included) must be a numeric value of
some committed docs/results/*.json, as the page rounds it, by the rule of tests/quoted_figures.py.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from quoted_figures import backed, json_numbers, quoted_numbers

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
JSON_FILES = sorted(RESULTS.glob("*.json"))


def results_section(readme: str) -> str:
    m = re.search(r"(?m)^## Results\b.*?$", readme)
    assert m, "no '## Results' section"
    nxt = re.search(r"(?m)^## ", readme[m.end():])
    return readme[m.end(): m.end() + nxt.start() if nxt else len(readme)]


def all_values() -> list:
    return [v for p in JSON_FILES for v in json_numbers(json.loads(p.read_text()))]


@pytest.mark.parametrize("path", JSON_FILES, ids=lambda p: p.name)
def test_results_file_starts_with_provenance(path):
    data = json.loads(path.read_text())
    assert list(data)[:4] == ["device", "date", "torch", "command"], list(data)[:6]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"]), data["date"]
    assert isinstance(data["command"], str) and "python" in data["command"], data["command"]
    md = path.with_suffix(".md")
    assert md.exists(), f"{md.name} missing: every results file has its Markdown beside it"
    assert data["command"] in md.read_text(), f"{md.name} does not quote the command in {path.name}"


def test_results_files_hold_no_hand_added_fields():
    """Fields that no writer produces (found in the audit): revision stamps, prose, run blocks."""
    def keys(obj):
        if isinstance(obj, dict):
            return set(obj) | {k for v in obj.values() for k in keys(v)}
        if isinstance(obj, list):
            return {k for v in obj for k in keys(v)}
        return set()

    for p in JSON_FILES:
        data = json.loads(p.read_text())
        found = keys(data) & {"handler_revision", "tf32_finding", "wrong_cc_model_ready", "worker_load_s"}
        # a prose "note" was hand-added at the top level; tests/test_graphs_gpu.py writes a
        # per-artifact "note" (the runner's own load-line text) inside its rows
        found |= {"note"} & set(data)
        assert not found, (p.name, found)


# the pages whose "## Results" section quotes measurements: the README's headline table and the
# performance page; any other docs/*.md page that grows a "## Results" section is checked too
PAGES_WITH_RESULTS = ("README.md", "docs/performance.md")


def pages_with_results() -> list:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [p for p in pages if re.search(r"(?m)^## Results\b", p.read_text())]


def test_the_pages_that_quote_results_have_a_results_section():
    found = {str(p.relative_to(ROOT)) for p in pages_with_results()}
    assert set(PAGES_WITH_RESULTS) <= found, found


@pytest.mark.parametrize("page", pages_with_results(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_number_in_a_results_section_is_backed(page):
    section = results_section(page.read_text())
    values = all_values()
    quoted = quoted_numbers(section)
    assert quoted, f"the Results section of {page.name} quotes no measurement: the rule matched nothing"
    unbacked = [(n, ctx) for n, ctx in quoted if not backed(n, values)]
    assert not unbacked, f"{page.name} numbers no committed results file holds:\n" + "\n".join(
        f"  {n!r} in ...{ctx}..." for n, ctx in unbacked)


def test_results_index_lists_every_results_set():
    index = (ROOT / "docs/results/README.md").read_text()
    stems = {p.stem for p in (ROOT / "docs/results").glob("*.json")}
    missing = sorted(s for s in stems if f"`{s}`" not in index)
    assert not missing, f"docs/results/README.md does not list: {missing}"
    linked = set(re.findall(r"\]\(([^)]+)\)", index)) - {"../performance.md"}
    gone = sorted(x for x in linked if not (ROOT / "docs/results" / x).exists())
    assert not gone, f"docs/results/README.md links files that do not exist: {gone}"


def test_the_number_rule_itself():
    """The matcher catches an invented number and ignores counts, names and thresholds."""
    text = ("ratio **1.11 at batch 1** (target <= 1.25), 1.07x steady, max diff 1.2e-7, took 22 s, 1.4-1.8 s; "
            "ResNet-50, batch 64, 4 workers, 2x H200, 1x3x2160x3840, torch 2.11.0, TorchServe 0.12, "
            "`bench_1.5.json`, 2026-11-22, tolerance 1e-4")
    assert [n for n, _ in quoted_numbers(text)] == ["1.11", "1.07", "1.2e-7", "22", "1.4", "1.8"]
    values = [1.1125, 1.0691, 1.1920928955078125e-07]
    assert backed("1.11", values) and backed("1.07", values) and backed("1.2e-7", values)
    assert not backed("22", values) and not backed("1.12", values) and not backed("1.3e-7", values)


def test_gpu_results_writer(tmp_path, monkeypatch):
    """The writer every GPU test module uses (conftest.write_gpu_results): provenance first, then
    exactly the measured values; nothing written without GPU_RESULTS."""
    from conftest import write_gpu_results

    monkeypatch.delenv("GPU_RESULTS", raising=False)
    write_gpu_results({"x": 1})
    assert not list(tmp_path.iterdir())
    out = tmp_path / "r.json"
    monkeypatch.setenv("GPU_RESULTS", str(out))
    write_gpu_results({"graphs": [{"mismatches": 0}]})
    data = json.loads(out.read_text())
    assert list(data) == ["device", "date", "torch", "command", "graphs"]
    assert data["command"].startswith(f"GPU_RESULTS={out} python ") and data["graphs"] == [{"mismatches": 0}]
