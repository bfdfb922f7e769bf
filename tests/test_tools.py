"""The GPU session's experiment script (`tools/gpu_experiment.py`) on the CPU, `smoke` preset, small shared data: the runs
it plans, a call that finishes its runs (compact, no checkpoints), and a deadline that stops runs and starts no more."""
import importlib.util, json, os, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_experiment.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_experiment", SCRIPT)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
    return m


def _run(out, data, *args):
    env = {**os.environ, "ALTGRAD_COMPILE": "never", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, SCRIPT, "--out", out, "--data-dir", data, "--preset", "smoke", "--jobs", "2", *map(str, args)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((Path(out) / "experiment.json").read_text())["runs"]


def test_plan():
    "The requirements' order with E0M7 left out (E1M6's grid), then E7M0 and E5M2 under each landing."
    m = _module()
    names = [r[0] for r in m.experiment("smoke")]
    assert names == ["reference", "E5M2", "E3M4", "E1M6", "E7M0", "E4M3", "E7M0-nearest", "E7M0-stochastic", "E7M0-kahan",
                     "E5M2-nearest", "E5M2-stochastic", "E5M2-kahan"], names
    assert [m.state_of(rc) for rc in (0, 143, 130, -15, 1, None)] == ["finished", "stopped at the deadline", "stopped at the deadline",
                                                                      "stopped at the deadline", "failed (exit 1)", "not started (deadline)"]


def test_runs_finish(tmp_path, small_data):
    "Three runs, two at a time: each finishes, is compacted (metrics.parquet, no checkpoints) and is recorded."
    runs = _run(tmp_path, small_data, "--deadline", 800, "--no-start", 10, "--only", "reference,E5M2,E7M0-nearest")
    assert {k: v["state"] for k, v in runs.items()} == dict.fromkeys(["reference", "E5M2", "E7M0-nearest"], "finished"), runs
    for d in (tmp_path / "_reference" / "smoke-s42-n20", tmp_path / "E5M2" / "run", tmp_path / "E7M0-nearest" / "run"):
        assert (d / "metrics.parquet").exists() and not list(d.glob("checkpoints*")), sorted(p.name for p in d.iterdir())
    cfg = (tmp_path / "E7M0-nearest" / "run" / "config.yaml").read_text()
    assert "weight_update: nearest" in cfg and "master_weights: format" in cfg, cfg


def test_deadline(tmp_path, small_data):
    "A 2 s deadline: the two runs under way are stopped (not counted as finished), the third never starts."
    runs = _run(tmp_path, small_data, "--deadline", 2, "--no-start", 0, "--grace", 30, "--only", "reference,E5M2,E7M0-nearest")
    assert {k: v["state"] for k, v in runs.items()} == {"reference": "stopped at the deadline", "E5M2": "stopped at the deadline",
                                                        "E7M0-nearest": "not started (deadline)"}, runs
