"""The collection check of tests/conftest.py: a test that compiles, starts TorchServe or runs the
project's scripts, itself or through a fixture, is found by its source, so an unmarked one fails
the collection instead of running under -m "not server"; a test that cannot run skips, and under
CI=true fails saying what was missing."""
from types import SimpleNamespace

from conftest import server_calls


def _starts_a_server(tmp_path):
    from compiled_serving.local_server import LocalTorchServe

    return LocalTorchServe(tmp_path / "run", tmp_path, {})


def _compiles(ep, tmp_path):
    import torch

    return torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "p.pt2"))


def _runs_a_script():
    import subprocess

    return subprocess.run(["bash", "scripts/quickstart.sh", "--stop"])


def _reads_the_readme():
    return "scripts/quickstart.sh" in "the README's text"


def _item(function, *fixtures):
    defs = {f.__name__: [SimpleNamespace(func=f)] for f in fixtures}
    return SimpleNamespace(function=function, _fixtureinfo=SimpleNamespace(name2fixturedefs=defs))


def names(calls: set) -> list:
    """The calls found, as the names they start with (the calls themselves, written here, would
    make this test one that the check finds)."""
    return sorted(c.strip('[("').split('"')[0] for c in calls)


def test_what_makes_a_server_test_is_found_in_the_test_or_its_fixtures():
    assert names(server_calls(_item(_starts_a_server))) == ["LocalTorchServe"]
    assert names(server_calls(_item(_reads_the_readme, _compiles))) == ["aoti_compile_and_package"]
    assert names(server_calls(_item(_runs_a_script))) == ["bash"]
    assert server_calls(_item(_reads_the_readme, _reads_the_readme)) == set()


def test_a_test_that_cannot_run_is_skipped_here_and_fails_under_ci(monkeypatch):
    import pytest

    from conftest import skip_or_fail_in_ci

    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="nothing to run with"):
        skip_or_fail_in_ci("nothing to run with")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true and this test cannot run: nothing to run with"):
        skip_or_fail_in_ci("nothing to run with")
