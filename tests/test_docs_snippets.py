"""The docs' Python snippets marked `<!-- snippet-test -->` run as written, in a scratch directory
(a snippet that no longer runs with the pinned packages, such as a keyword a library dropped,
fails here rather than on a reader's machine)."""
import re
import subprocess
import sys

import pytest

from conftest import ROOT

MARK = re.compile(r"<!-- snippet-test -->\s*```python\n(.*?)```", re.S)


def snippets():
    for page in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        for i, m in enumerate(MARK.finditer(page.read_text())):
            yield pytest.param(m.group(1), id=f"{page.name}#{i}")


def test_at_least_the_transformers_snippet_is_marked():
    assert any("attn_implementation" in p.values[0] for p in snippets())


@pytest.mark.parametrize("code", list(snippets()))
def test_snippet_runs_as_written(code, tmp_path):
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "artifacts").exists() or "artifacts/" not in code
