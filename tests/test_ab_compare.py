"""benchmarks/ab_compare.py on a stand-in benchmark: the reference package found through --ref-site, the current
one through the ordinary path, runs in turns, medians and ratios per point and metric."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

FAKE_BENCH = '''
import argparse, json
import abfake
p = argparse.ArgumentParser()
p.add_argument("--size", type=int)
p.add_argument("--json")
a = p.parse_args()
rows = [{"shape": f"{a.size}x{d}", "causal": c, "tk_fwd_ms": 1.0, "tk_fwd_tflops": abfake.SPEED * d,
         "cudnn_fwd_tflops": 50.0} for d in (1, 2) for c in (False, True)]
json.dump({"rows": rows}, open(a.json, "w"))
'''


def load_ab_compare():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "ab_compare.py"
    spec = importlib.util.spec_from_file_location("ab_compare", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_alternating_runs_compare_tk_metrics_per_point(tmp_path, monkeypatch, capsys):
    ab = load_ab_compare()
    bench_dir, current, ref = tmp_path / "bench", tmp_path / "current", tmp_path / "ref"
    for d in (bench_dir, current, ref):
        d.mkdir()
    (bench_dir / "fake.py").write_text(FAKE_BENCH)
    (current / "abfake.py").write_text("SPEED = 110.0\n")
    (ref / "abfake.py").write_text("SPEED = 100.0\n")
    monkeypatch.setattr(ab, "BENCH_DIR", bench_dir)
    monkeypatch.setenv("PYTHONPATH", str(current))
    out = tmp_path / "ab.json"
    ab.main(["--ref-site", str(ref), "--ref-label", "abc1234", "--rounds", "3", "--json", str(out),
             "fake", "--size", "7"])
    data = json.loads(out.read_text())
    assert data["reference"] == "abc1234" and data["rounds"] == 3
    # Four points, one tk metric each (tk_fwd_ms is not a rate; cuDNN is not ours).
    assert len(data["results"]) == 4
    for r in data["results"]:
        assert r["metric"] == "tk_fwd_tflops"
        assert len(r["current_all"]) == 3 and len(r["reference_all"]) == 3
        assert abs(r["ratio"] - 1.1) < 1e-9
    assert "shape=7x2 causal=True" in {r["point"] for r in data["results"]}
    assert "geometric mean current/abc1234: 1.100" in capsys.readouterr().out
    assert (tmp_path / "ab_runs.log").read_text().count("$ ") == 6


def test_a_failing_side_stops_with_its_name(tmp_path, monkeypatch):
    ab = load_ab_compare()
    (tmp_path / "broken.py").write_text("raise SystemExit('no kernels here')\n")
    monkeypatch.setattr(ab, "BENCH_DIR", tmp_path)
    try:
        ab.main(["--ref-site", str(tmp_path), "--json", str(tmp_path / "x.json"), "broken"])
    except SystemExit as e:
        assert "current run failed" in str(e)
    else:
        raise AssertionError("expected the failed run to stop the comparison")


KNOB_BENCH = '''
import argparse, json, os
p = argparse.ArgumentParser()
p.add_argument("--json")
a = p.parse_args()
speed = {"0": 100.0, "1": 90.0, "2": 120.0}[os.environ["ABFAKE_KNOB"]]
json.dump({"rows": [{"shape": "s", "tk_fwd_tflops": speed}]}, open(a.json, "w"))
'''


def test_knob_runs_one_build_per_value_against_the_first(tmp_path, monkeypatch, capsys):
    ab = load_ab_compare()
    (tmp_path / "knob.py").write_text(KNOB_BENCH)
    monkeypatch.setattr(ab, "BENCH_DIR", tmp_path)
    out = tmp_path / "k.json"
    ab.main(["--knob", "ABFAKE_KNOB=0,1,2", "--rounds", "3", "--json", str(out), "knob"])
    data = json.loads(out.read_text())
    assert data["knob"] == "ABFAKE_KNOB" and data["reference"] == "0"
    assert abs(data["results"]["1"][0]["ratio"] - 0.9) < 1e-9
    assert abs(data["results"]["2"][0]["ratio"] - 1.2) < 1e-9
    assert "geometric mean ABFAKE_KNOB=2/ABFAKE_KNOB=0: 1.200" in capsys.readouterr().out
    assert (tmp_path / "k_runs.log").read_text().count("$ ABFAKE_KNOB=") == 9


def load_ab_inprocess(monkeypatch):
    bench_dir = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench_dir))  # it imports attention.py and common.py beside it
    spec = importlib.util.spec_from_file_location("ab_inprocess", bench_dir / "ab_inprocess.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_in_process_reference_imports_under_its_own_name(tmp_path, monkeypatch):
    """The reference package is copied with its module names rewritten and imported beside the current one, without
    its __init__ (which would register a second Thunder executor)."""
    ab = load_ab_inprocess(monkeypatch)
    site = tmp_path / "site" / "thunder_tk"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("raise RuntimeError('the reference __init__ must not run')\n")
    (site / "_extension.py").write_text("WHO = 'reference'\n")
    (site / "ops.py").write_text("from thunder_tk import _extension\nimport thunder_tk._extension as ext2\n"
                                 "NAME = 'thunder_tk.ops'\nSPEED = _extension.WHO\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(sys, "path", list(sys.path))
    ops = ab.import_renamed(tmp_path / "site", work, name="thunder_tk_abtest")
    try:
        assert ops.__name__ == "thunder_tk_abtest.ops"
        assert ops.SPEED == "reference" and ops.ext2.__name__ == "thunder_tk_abtest._extension"
        assert ops.NAME == "thunder_tk_abtest.ops"
    finally:
        for key in [k for k in sys.modules if k.startswith("thunder_tk_abtest")]:
            del sys.modules[key]


def test_in_process_reference_must_exist(tmp_path, monkeypatch):
    ab = load_ab_inprocess(monkeypatch)
    with pytest.raises(SystemExit, match="no thunder_tk package"):
        ab.import_renamed(tmp_path, tmp_path)


def test_in_process_rise_takes_numbers_or_random(tmp_path, monkeypatch, capsys):
    """--rise names the inputs (rising scores per key block, or random ones); anything else is an argument error
    named as such, before any GPU is looked for."""
    ab = load_ab_inprocess(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        ab.main(["--ref-site", str(tmp_path), "--rise", "random", "steep"])
    assert exc.value.code == 2
    assert "--rise takes numbers" in capsys.readouterr().err
