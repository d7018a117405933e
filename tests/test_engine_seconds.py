"""bench/engine_seconds.py: the engine's per-second account from its sampler's snapshots."""
import json

from bench import engine_seconds


def snap(t, rows, jobs, calls, replays, busy, **clock):
    return {"t": t, "rows": rows, "jobs": jobs, "calls": calls, "replays": replays, "device_busy_s": busy,
            "clock_s": clock}


def test_a_busy_second_is_kept_with_its_rates_and_fractions_and_an_idle_one_is_not():
    snaps = [snap(0.0, 0, 0, 0, 0, 0.0, idle=0.0), snap(1.0, 100, 10, 5, 5, 0.05, idle=0.9),
             snap(3.0, 40100, 5010, 2005, 2105, 1.95, idle=0.92, launch=1.0, job_queued=2.5, job_flight=10.0)]
    out = engine_seconds.seconds(snaps, min_rows=2000)
    assert len(out) == 1  # the first second answered 100 rows
    s = out[0]
    assert s["rows_s"] == 20000.0 and s["jobs_s"] == 2500.0 and s["steps_s"] == 1000.0 and s["replays_s"] == 1050.0
    assert s["device_busy"] == 0.95 and s["loop"] == {"idle": 0.01, "launch": 0.5}
    assert s["queued_ms_per_job"] == 0.5 and s["flight_ms_per_job"] == 2.0


def test_the_files_are_matched_to_the_variants_in_the_order_the_engines_started(tmp_path):
    result = tmp_path / "r.json"
    result.write_text(json.dumps({"device": "x", "points": []}))
    (tmp_path / "r.md").write_text("# r\n")
    late = [snap(10.0, 0, 0, 0, 0, 0.0), snap(11.0, 5000, 500, 100, 100, 0.5)]
    early = [snap(1.0, 0, 0, 0, 0, 0.0), snap(2.0, 3000, 300, 100, 100, 0.25)]
    for name, s in (("sample.9.json", early), ("sample.10.json", late)):
        (tmp_path / name).write_text(json.dumps({"snapshots": s}))
    engine_seconds.main(["--result", str(result), "--samples", str(tmp_path / "sample.10.json"),
                         str(tmp_path / "sample.9.json"), "--variants", "ours_engine12,ours_engine24"])
    out = json.loads(result.read_text())["engine_seconds"]
    assert out["ours_engine12"]["file"] == "sample.9.json" and out["ours_engine12"]["seconds"][0]["rows_s"] == 3000.0
    assert out["ours_engine24"]["seconds"][0]["device_busy"] == 0.5
    engine_seconds.main(["--result", str(result), "--samples", str(tmp_path / "sample.10.json"),
                         str(tmp_path / "sample.9.json"), "--variants", "ours_engine12,ours_engine24"])
    assert (tmp_path / "r.md").read_text().count("## The engine's own account") == 1  # replaced, not added again


def test_each_file_goes_to_the_model_its_engine_is_named_for(tmp_path):
    """An engine names itself engine-MODEL (handlers/engine/link.py) and its sampler writes the name,
    so every model of a run that started them all at once gets its own engine's account, and an
    engine of a model the result does not hold is left out."""
    from handlers.engine.sampler import Sampler

    result = tmp_path / "r.json"
    result.write_text(json.dumps({"device": "x", "points": [{"handler": "ours"}, {"handler": "ours_late"}]}))
    (tmp_path / "r.md").write_text("# r\n")
    busy = [snap(1.0, 0, 0, 0, 0, 0.0), snap(2.0, 3000, 300, 100, 100, 0.25)]
    for pid, name, rows in ((7, "engine-ours_late", 5000), (8, "engine-ours", 3000), (9, "engine-elsewhere", 9000)):
        s = Sampler(str(tmp_path / f"sample.{pid}.json"), name=name)
        s.snapshots = [busy[0], {**busy[1], "rows": rows}]
        s.write(rows=rows)
    assert engine_seconds.main(["--result", str(result), "--samples", *map(str, tmp_path.glob("sample.*.json"))]) == 0
    got = json.loads(result.read_text())["engine_seconds"]
    assert sorted(got) == ["ours", "ours_late"]
    assert got["ours"]["seconds"][0]["rows_s"] == 3000.0 and got["ours_late"]["seconds"][0]["rows_s"] == 5000.0
    assert "| ours_late | 5000.0 |" in (tmp_path / "r.md").read_text()
