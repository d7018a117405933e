"""Dynamic batching through real TorchServe (batchSize 8, maxBatchDelay 600 ms): each request
gets exactly its own rows; one bad request fails alone; oversize batches are split, undersize
ones padded, refused where configured."""
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import close, eager, image, two

pytestmark = pytest.mark.server


def fire(server, model, bodies):
    """Send all bodies at once (a barrier lines them up inside one batching window)."""
    barrier = threading.Barrier(len(bodies))

    def one(body):
        barrier.wait()
        return server.predict(model, body)

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


def body(f, m) -> dict:
    return {"inputs": {"features": f.tolist(), "mask": m.tolist()}}


def fire_and_compare(server, model, sizes, seed):
    """Concurrent requests of the given row counts; each answer must equal eager on its rows."""
    inputs = [two(n, seed=seed + i) for i, n in enumerate(sizes)]
    for r, (f, m) in zip(fire(server, model, [body(f, m) for f, m in inputs]), inputs):
        assert r.status_code == 200, r.text
        close(r.json()["outputs"], eager("two_input", f, m))


def test_mixed_sizes_get_their_own_rows(main_server):
    fire_and_compare(main_server, "two_aoti", [1, 3, 2, 5, 1, 4, 2, 6], seed=100)


def test_one_bad_request_fails_alone(main_server):
    inputs = [two(2, seed=200 + i) for i in range(8)]
    bodies = [body(f, m) for f, m in inputs]
    bodies[5] = body(inputs[5][0], torch.randn(2, 16))
    before = main_server.log().count("request(s) rejected")
    responses = fire(main_server, "two_aoti", bodies)
    for i, (r, (f, m)) in enumerate(zip(responses, inputs)):
        if i == 5:
            assert r.status_code == 400, r.text
            assert "input 'mask'" in r.json()["message"] and "bool" in r.json()["message"]
        else:
            assert r.status_code == 200, (i, r.text)
            close(r.json()["outputs"], eager("two_input", f, m))
    # the bad request really shared a batch with good ones
    lines = [ln for ln in main_server.log().splitlines() if "request(s) rejected" in ln][before:]
    assert any("1 of " in ln and "1 of 1 " not in ln for ln in lines), lines


def test_batch_larger_than_artifact_max_is_split(main_server):
    # two_small accepts 2..4 rows per call; 8 concurrent requests of 1..3 rows exceed it
    fire_and_compare(main_server, "two_small", [1, 2, 3, 1, 3, 2, 1, 2], seed=300)
    f, m = two(11, seed=399)  # one request of 11 rows: 3 calls (4, 4, 3)
    r = main_server.predict("two_small", body(f, m))
    assert r.status_code == 200
    close(r.json()["outputs"], eager("two_input", f, m))


def test_below_minimum_is_padded(main_server):
    f, m = two(1, seed=400)  # two_small needs at least 2 rows per call
    r = main_server.predict("two_small", body(f, m))
    assert r.status_code == 200
    close(r.json()["outputs"], eager("two_input", f, m))
    x = image(1, seed=401)  # fixed batch 4 artifact
    r = main_server.predict("cls_fixed4", {"inputs": {"image": x.tolist()}})
    assert r.status_code == 200
    close(r.json()["outputs"], eager("classifier", x))
    x = image(6, seed=402)  # and 6 rows: one call of 4, one of 2 padded to 4
    r = main_server.predict("cls_fixed4", {"inputs": {"image": x.tolist()}})
    assert r.status_code == 200
    close(r.json()["outputs"], eager("classifier", x))


def test_oversized_request_refused_when_split_disabled(main_server):
    r = main_server.predict("cls_nosplit", {"inputs": {"image": image(17).tolist()}})
    assert r.status_code == 413
    assert "at most 16" in r.json()["message"]
    r = main_server.predict("cls_nosplit", {"inputs": {"image": image(16).tolist()}})
    assert r.status_code == 200


def test_model_failure_fails_only_the_culprit(main_server):
    """A request valid by the input contract on which the model itself fails (an id outside the
    embedding table, with the value checks switched off): the batch fails, the handler retries
    the requests one by one, the culprit gets 400 naming the failure (its own values caused it)
    and every other request its own correct answer."""
    g = torch.Generator().manual_seed(500)
    ids = [torch.randint(0, 8, (1 + i % 3, 3), generator=g) for i in range(8)]
    ids[3] = torch.tensor([[1, 2, 3], [4, 8, 5]])  # 8: one past the table
    before = main_server.log().count("retrying requests one by one")
    responses = fire(main_server, "lookup", [{"inputs": {"ids": x.tolist()}} for x in ids])
    for i, (r, x) in enumerate(zip(responses, ids)):
        if i == 3:
            assert r.status_code == 400, r.text
            assert r.json() == {"code": 400, "type": "InvalidInput",
                                "message": "the model cannot index with this request's values (IndexError: "
                                           "index out of range in self); check the values of ids against "
                                           "the model's tables"}
        else:
            assert r.status_code == 200, (i, r.text)
            close(r.json()["outputs"], eager("lookup", x))
    # the culprit really shared a failed batch with good requests (only a batch of several is
    # retried one by one; a request alone fails directly)
    lines = [ln for ln in main_server.log().splitlines() if "retrying requests one by one" in ln][before:]
    assert len(lines) == 1 and "index out of range in self" in lines[0], lines
    alone = main_server.predict("lookup", {"inputs": {"ids": [[9, 0, 0]]}})
    assert alone.status_code == 400 and "index out of range" in alone.json()["message"]
    ok = main_server.predict("lookup", {"inputs": {"ids": ids[0].tolist()}})
    assert ok.status_code == 200  # the worker survived


def test_value_contract_refuses_bad_ids_before_the_model(main_server):
    """The same model with its value contract (the default): ids past the 8-row table or
    negative are refused in admission with the range the graph gave, inside a batch of good
    requests that are all answered correctly; nothing reaches the model, nothing is retried."""
    g = torch.Generator().manual_seed(501)
    ids = [torch.randint(0, 8, (1 + i % 3, 3), generator=g) for i in range(8)]
    ids[2] = torch.tensor([[1, 2, 3], [4, 8, 5]])
    ids[5] = torch.tensor([[0, -1, 0]])
    before = main_server.log().count("retrying requests one by one")
    responses = fire(main_server, "lookup_checked", [{"inputs": {"ids": x.tolist()}} for x in ids])
    for i, (r, x) in enumerate(zip(responses, ids)):
        if i in (2, 5):
            value, pos = (8, [1, 1]) if i == 2 else (-1, [0, 1])
            assert r.status_code == 400, r.text
            assert r.json()["message"] == (f"input 'ids' holds {value} at position {pos}; this model accepts "
                                           "values from 0 to 7 (embedding table of 8 rows)"), r.text
        else:
            assert r.status_code == 200, (i, r.text)
            close(r.json()["outputs"], eager("lookup", x))
    assert main_server.log().count("retrying requests one by one") == before
