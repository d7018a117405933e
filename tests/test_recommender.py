"""A recommender as users write one (issue 38): dense float [B,13] and int64 sparse [B,3] whose
column j indexes its own embedding table (100, 5000 and 20 rows), exported with torch.export
(no AOTInductor compile: the value contract does not depend on the artifact kind), imported
from the .pt2 as the archive imports it and served by real TorchServe. The contract holds a range
per column (the import's line, inspect_artifact, the worker's load line), admission checks each
column (400 naming the column and its range), a whole-input range that fits only the largest
table is refused naming the smallest, and with check_values off the model's own index error is a
400 without native file paths."""
import json
import subprocess

import pytest
import torch
from conftest import PY, ROOT, build_mar, cs_command
from torch import nn
from torch.export import Dim

pytestmark = pytest.mark.server

TABLES = (100, 5000, 20)
SHOWN = "sparse: int64[Bx3] per column of dimension 1: 0 in [0, 99] | 1 in [0, 4999] | 2 in [0, 19]"


class Recommender(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(13, 8)
        self.tables = nn.ModuleList(nn.Embedding(n, 8) for n in TABLES)
        self.head = nn.Linear(8, 1)

    def forward(self, dense, sparse):
        h = self.dense(dense)
        for j, table in enumerate(self.tables):
            h = h + table(sparse[:, j])
        return self.head(torch.relu(h))


@pytest.fixture(scope="session")
def rec_files(tmp_path_factory):
    """program.pt2 as a user's pipeline saves it, and the directory the import writes from it."""
    d = tmp_path_factory.mktemp("recommender")
    torch.manual_seed(0)
    model = Recommender().eval()
    batch = Dim("batch", min=1, max=64)
    ep = torch.export.export(model, (torch.randn(2, 13), torch.zeros(2, 3, dtype=torch.long)),
                             dynamic_shapes={"dense": {0: batch}, "sparse": {0: batch}})
    torch.export.save(ep, d / "program.pt2")
    r = subprocess.run([*cs_command("import_artifact"), "--artifact", str(d / "program.pt2"), "--out",
                        str(d / "imported")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return d, model, r.stdout


@pytest.fixture(scope="session")
def rec_server(rec_files, serve, tmp_path_factory):
    d, _, _ = rec_files
    store = tmp_path_factory.mktemp("rec_store")
    mars = {"rec": build_mar(d / "imported", "rec", store),
            "rec_nocheck": build_mar(d / "imported", "rec_nocheck", store, "--handler-option", "check_values=false")}
    return serve(mars)


def request(ids, rows: int = 1) -> dict:
    g = torch.Generator().manual_seed(sum(ids))
    return {"inputs": {"dense": torch.randn(rows, 13, generator=g).tolist(), "sparse": [list(ids)] * rows}}


def test_the_contract_holds_a_range_per_column(rec_files):
    """What the import prints, artifact.json (layout 3) and inspect_artifact all carry each
    column's own table; a range for the whole input that fits only the largest table is
    refused naming the smallest (it was accepted and silently ignored)."""
    d, _, printed = rec_files
    assert SHOWN in printed, printed
    raw = json.loads((d / "imported" / "artifact.json").read_text())
    assert raw["format"] == 3
    assert [(c["min"], c["max"], c["source"]) for c in raw["inputs"][1]["values"]["columns"]] == \
        [(0, n - 1, f"embedding table of {n} rows") for n in TABLES]
    shown = subprocess.run([*cs_command("inspect_artifact"), str(d / "imported")], cwd=ROOT,
                           capture_output=True, text=True)
    assert shown.returncode == 0 and SHOWN in shown.stdout, shown.stdout
    wide = subprocess.run([*cs_command("import_artifact"), "--artifact", str(d / "program.pt2"), "--out",
                           str(d / "wide"), "--input-range", "sparse=0:4999"], cwd=ROOT, capture_output=True, text=True)
    refusal = ("--input-range sparse=0:4999 is wider than what the model accepts: column 0 of input 'sparse' takes "
               "values from 0 to 99 (embedding table of 100 rows)")
    assert wide.returncode != 0 and refusal in wide.stderr, wide.stderr


def test_each_column_is_checked_against_its_own_table(rec_server, rec_files):
    """50 in column 0 and 840 in column 1 are valid (the smallest table's range refused both);
    5000 in column 1 and 20 in column 2 are refused in admission naming the column and range."""
    _, model, _ = rec_files
    body = request((50, 840, 19), rows=2)
    r = rec_server.predict("rec", body)
    assert r.status_code == 200, r.text
    with torch.no_grad():
        want = model(torch.tensor(body["inputs"]["dense"]), torch.tensor(body["inputs"]["sparse"]))
    torch.testing.assert_close(torch.tensor(r.json()["outputs"]["output"]), want, rtol=1e-5, atol=1e-5)
    for ids, col, hi in (((50, 5000, 3), 1, 4999), ((50, 840, 20), 2, 19)):
        r = rec_server.predict("rec", request(ids))
        assert r.status_code == 400, r.text
        assert r.json()["message"] == (f"input 'sparse' holds {ids[col]} at position [0, {col}]; column {col} of this "
                                       f"input (dimension 1) accepts values from 0 to {hi} (embedding table of "
                                       f"{hi + 1} rows)")
    loaded = [ln for ln in rec_server.log().splitlines() if "-rec_1.0" in ln and " artifact model.pt2 " in ln]
    assert loaded and all(SHOWN in ln and "values checked: sparse per column of dimension 1: 0 in [0, 99] | "
                          "1 in [0, 4999] | 2 in [0, 19]" in ln for ln in loaded), loaded


def test_with_checks_off_the_models_index_error_is_a_400_without_native_paths(rec_server):
    r = rec_server.predict("rec_nocheck", request((50, 840, 20)))
    assert r.status_code == 400, r.text
    message = r.json()["message"]
    assert message.startswith("the model cannot index with this request's values (IndexError: index out of range in "
                              "self); check the values of sparse"), message
    assert "/" not in message and "Exception raised from" not in message and "\n" not in message
    assert rec_server.predict("rec_nocheck", request((50, 840, 19))).status_code == 200  # the worker serves on
