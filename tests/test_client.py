"""What a newcomer runs: the README's serve-and-call commands agree with each other and with the
quickstart, compile on a CPU-only machine, and compiled_serving.client (the README's and the quickstart's
client) checks every format against eager and explains a missing token, run from elsewhere."""
import json
import re
import shlex
import subprocess

import pytest

from conftest import PY, ROOT, cs_command

# the compile / archive / serve reference moved from the README to docs/usage.md
README = (ROOT / "docs" / "usage.md").read_text()


def section(title):
    m = re.search(rf"(?ms)^## {re.escape(title)}.*?(?=^## )", README)
    assert m, title
    return m.group(0)


def commands(text, program):
    """Shell commands in ```bash blocks of `text` that run `program` (continuations joined)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if program in line:
                out.append(shlex.split(line.split("#")[0]) if "'" not in line else line)
    return out


@pytest.mark.server
def test_serve_and_call_name_the_model_that_compile_and_archive_build():
    compile_cmd = commands(section("Compile: `cs-compile`"), "cs-compile")[0]
    archive_cmd = commands(section("Archive: `cs-archive`"), "cs-archive")[0]
    serve = commands(section("Serve and call"), "torchserve --start")[0]
    assert compile_cmd[compile_cmd.index("--device") + 1] == "cpu"  # runs on a CPU-only machine
    out = compile_cmd[compile_cmd.index("--out") + 1]
    assert archive_cmd[archive_cmd.index("--artifact") + 1] == out
    name = archive_cmd[archive_cmd.index("--name") + 1]
    served = dict(m.split("=") for m in [serve[serve.index("--models") + 1]])
    assert served == {name: f"{name}.mar"}
    urls = [u for u in re.findall(r"/predictions/(\w+)", section("Serve and call")) if u != "NAME"]
    assert urls and set(urls) == {name}, urls


def test_quickstart_model_is_the_one_the_readme_tells_to_call():
    quick = (ROOT / "scripts" / "quickstart.sh").read_text()
    served = re.search(r"--models (\w+)=", quick).group(1)
    assert f"cs-client --model {served}" in section("Serve and call")


@pytest.mark.server
@pytest.mark.parametrize("fmt", ["json", "v1", "v2", "safetensors"])
def test_client_checks_every_format_against_eager(main_server, tmp_path, fmt):
    import json

    keys = tmp_path / "key_file.json"
    keys.write_text(json.dumps(main_server.keys))
    r = subprocess.run([*cs_command("client"), "--model", "cls_export", "--url", main_server.base,
                        "--key-file", str(keys), "--example", "image:2x3x32x32:float32", "--format", fmt,
                        "--check-eager", "--factory", "examples/models.py:classifier"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "(OK)" in r.stdout, r.stdout + r.stderr


@pytest.mark.server
def test_client_from_another_directory_says_where_the_token_comes_from(main_server, tmp_path):
    """A --key-file that does not exist stops the client before it sends anything; a key file of
    another server's gets the server's refusal and says which file the token came from."""
    def client(key_file):
        return subprocess.run([*cs_command("client"), "--model", "cls_export", "--url", main_server.base,
                               "--key-file", str(key_file), "--example", "image:1x3x32x32:float32"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    r = client(tmp_path / "nowhere.json")
    assert r.returncode == 1 and "--key-file" in r.stderr and "no such file" in r.stderr, r.stderr
    stale = tmp_path / "stale_key_file.json"
    stale.write_text(json.dumps({"inference": {"key": "not-this-servers-key"}}))
    r = client(stale)
    assert r.returncode == 1
    assert "stale_key_file.json was refused" in r.stderr and "--key-file" in r.stderr, r.stderr
