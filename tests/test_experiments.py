"System tests of the experiment layer: the papermill notebook and the sweep CLI, on the smoke preset."
import json, os, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ["## Setup", "## Results", "## Loss", "## Gradient agreement", "## Where the format hurts: overflow",
            "## Where the format hurts: underflow", "## Where the format hurts: bit-stall", "## Code histograms",
            "## Interventions", "## Failure analysis", "## Verdict"]
FIGURES = {"loss.png", "grad_cosine.png", "overflow_heatmap.png", "underflow_heatmap.png", "stall_heatmap.png", "histograms.png"}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("experiments")


@pytest.mark.parametrize("fmt", ["E5M2", "E7M0"])
def test_run_format_papermill(out, fmt):
    import papermill as pm
    nb_out = out / f"{fmt}.ipynb"
    pm.execute_notebook(str(ROOT / "nbs" / "run_format.ipynb"), str(nb_out), cwd=str(ROOT), kernel_name="python3",
                        parameters=dict(fmt=fmt, preset="smoke", steps=12, out_dir=str(out)), progress_bar=False)
    report = (out / fmt / "report.md").read_text()
    for s in SECTIONS: assert s in report, f"{fmt}: missing section {s}"
    last = report.split("\n## ")[-1].splitlines()
    assert last[0] == "Verdict"
    verdict = [l for l in last if l.strip()][1]
    assert verdict.startswith("Verdict: ") and (verdict in ("Verdict: PASS", "Verdict: UNSTABLE") or verdict.startswith("Verdict: FAIL at step "))
    assert FIGURES <= {p.name for p in (out / fmt / "figures").glob("*.png")}, "figures missing"
    assert "Not available for this run" not in report, "a figure section had no data"
    metrics = [json.loads(l) for l in (out / fmt / "metrics.jsonl").read_text().splitlines() if l.strip()]
    assert metrics[0]["step"] == 1 and any(k.startswith("overflow/") for k in metrics[0])
    executed = json.loads(nb_out.read_text())
    assert any("Verdict: " in "".join(o.get("text", "")) for c in executed["cells"] for o in c.get("outputs", []))


def test_reference_reused(out):
    "The second format run above reused the reference trained by the first."
    refs = list((out / "_reference").iterdir())
    assert len(refs) == 1 and (refs[0] / "summary.json").exists()


def test_sweep_cli(tmp_path):
    env = {**os.environ}
    r = subprocess.run(["altgrad-sweep", "--preset", "smoke", "--out", str(tmp_path), "--steps", "8", "--formats", "E3M4",
                        "--no-retry"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    md = (tmp_path / "summary.md").read_text()
    assert "| [E3M4](E3M4/report.md) | E3M4 | uniform |" in md
    assert (tmp_path / "E3M4" / "report.md").exists() and (tmp_path / "summary.png").exists()
    assert "unigram baseline" in md and (tmp_path / "reference.png").exists() and "Master weights: FP32" in md
    # a second call reuses the finished runs (an interrupted sweep continues) and writes the same table
    r2 = subprocess.run(r.args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r2.returncode == 0 and "E3M4: reusing the finished run" in r2.stdout, r2.stdout[-2000:] + r2.stderr[-2000:]
    assert (tmp_path / "summary.md").read_text() == md


def test_sweep_cli_bad_format(tmp_path):
    r = subprocess.run(["altgrad-sweep", "--formats", "E9M9", "--out", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "valid formats: E5M2" in r.stderr
