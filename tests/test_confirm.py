"System tests of the confirmatory study (altgrad.confirm) on the smoke preset: branches, ECO, workers, the one-table storage."
import json, math, os, shutil
from pathlib import Path
import pytest
import torch

from altgrad.config import load_config
from altgrad.confirm import (Design, Spec, collect, finished_runs, plan, read_steps, read_table, run_dir, spec_config, todo, work,
                             write_table)
from altgrad.trainer import Trainer

TINY = Design(preset="smoke", steps=8, trunk_step=4, formats=("E6M1", "E7M0"), regimes=("nearest", "stochastic", "kahan", "eco"),
              base_mults=(1.0,), max_extensions=0, tuning_units=((5, 6),), heldout_inits=(7, 9), heldout_datas=(8,),
              law_regimes=("nearest", "stochastic"))
FIXTURE = Path(__file__).parent / "fixtures" / "confirm"       # TINY's table and answer, made by `python tests/test_confirm.py`
MACHINE = FIXTURE / "machine.json"     # where and from what it was trained: its losses are that machine's, bit for bit
LOSS_TOL = 2.5e-3                      # nats, on another machine. Observed: two machines 1.15e-3 apart at most
                                       # (2026-11-28). Loose: it sees a broken regime (Kahan's effects here are 3.2e-3 to
                                       # 6.9e-3) only in part, and ECO vs stochastic (under 1e-3) not at all


def machine() -> dict:
    """What decides this machine's float results: the CPU (vendor, family, model, stepping, flags; a VM may mask the
    model name), ATen's vector instruction set, torch and its build (MKL, oneDNN). Vectorised exp and log and reduction
    orders differ between CPUs by an ulp, and one ulp can flip an 8-bit rounding, so a trajectory is reproducible bit
    for bit on the same kind of machine only."""
    import hashlib, platform
    info = Path("/proc/cpuinfo").read_text().split("\n\n")[0] if Path("/proc/cpuinfo").exists() else ""
    f = dict(l.split(":", 1) for l in info.splitlines() if ":" in l)
    f = {k.strip(): v.strip() for k, v in f.items()}
    cpu = {k: f.get(k, "") for k in ("vendor_id", "cpu family", "model", "stepping", "model name")}
    cpu["model name"] = cpu["model name"] or platform.processor()
    sha = lambda t: hashlib.sha256(t.encode()).hexdigest()[:16]
    return dict(cpu=cpu, flags_sha=sha(f.get("flags", "")), cpu_capability=torch.backends.cpu.get_cpu_capability(),
                torch=torch.__version__, torch_build_sha=sha(torch.__config__.show()))


@pytest.fixture(autouse=True)
def eager_kernels(monkeypatch):
    "Smoke-sized tensors: eager quantization kernels (same numbers) spare the torch.compile warm-up."
    monkeypatch.setenv("ALTGRAD_COMPILE", "never")


def _state(t: Trainer) -> list:
    return [v for v in t.model.state_dict().values() if torch.is_tensor(v)] + \
           [s for st in t.optimizer.state.values() for s in st.values() if torch.is_tensor(s)]


def test_fp32_branch_continues_trunk(tmp_path, small_data):
    "A branch that changes nothing (FP32 master weights, x1) continues its trunk bit for bit; a branch may change only the regime."
    base = dict(fmt="E5M2", seed=3, data_seed=4, data_dir=str(small_data), wandb_mode="disabled", max_steps=12, checkpoint_interval=6,
                eval_interval=6)
    full = Trainer(load_config("smoke", out_dir=str(tmp_path / "full"), **base), progress=False); full.fit()
    trunk = Trainer(load_config("smoke", out_dir=str(tmp_path / "trunk"), **{**base, "max_steps": 6, "lr_decay_steps": 12}), progress=False)
    trunk.fit()
    ck = tmp_path / "trunk" / "checkpoints" / "step_000006.pt"
    br = Trainer(load_config("smoke", out_dir=str(tmp_path / "br"), init_from=str(ck), **base), progress=False)
    s = br.fit()
    assert (s["init_step"], s["steps_this_run"], s["final_step"]) == (6, 6, 12)
    assert all(torch.equal(a, b) for a, b in zip(_state(full), _state(br)))
    assert s["final_val_loss"] == full.last_val_loss
    other = Trainer(load_config("smoke", out_dir=str(tmp_path / "other"), **{**base, "data_seed": 9}), progress=False)
    assert not torch.equal(next(iter(other.next_batches()))[0], next(iter(Trainer(load_config(
        "smoke", out_dir=str(tmp_path / "x"), **base), progress=False).next_batches()))[0])          # data_seed moves the data alone
    with pytest.raises(ValueError, match="cannot branch from .*lr=0.001 there, 0.002 here"):
        Trainer(load_config("smoke", out_dir=str(tmp_path / "bad"), init_from=str(ck), **{**base, "lr": 0.002}), progress=False)
    with pytest.raises(ValueError, match="cannot be read as a checkpoint"):
        Trainer(load_config("smoke", out_dir=str(tmp_path / "bad2"), init_from=str(tmp_path / "nope.pt"), **base), progress=False)


def test_eco_branch_lands_on_grid(tmp_path, small_data):
    "An ECO branch keeps its weights on the grid and its error in AdamW's momentum (no residual buffer), and differs from stochastic rounding."
    base = dict(fmt="E4M3", seed=3, data_dir=str(small_data), wandb_mode="disabled", max_steps=8, checkpoint_interval=4, eval_interval=4)
    Trainer(load_config("smoke", out_dir=str(tmp_path / "trunk"), **{**base, "max_steps": 4, "lr_decay_steps": 8}), progress=False).fit()
    ck = str(tmp_path / "trunk" / "checkpoints" / "step_000004.pt")
    runs = {}
    for wu in ("stochastic", "eco"):
        t = Trainer(load_config("smoke", out_dir=str(tmp_path / wu), init_from=ck, master_weights="format", weight_update=wu, **base),
                    progress=False)
        t.fit(); runs[wu] = t
    from altgrad.quantized import quantized_layers
    from altgrad.formats import quantize
    for _, m in quantized_layers(runs["eco"].model):
        w = m.weight.detach()
        assert torch.equal(quantize(w * m.grid_scale, m.fmt) / m.grid_scale, w)       # on the grid
        assert m.residual.numel() == 0 and m._landing_error is None                    # no buffer kept, error handed over
    assert not all(torch.equal(a, b) for a, b in zip(_state(runs["eco"]), _state(runs["stochastic"])))


def test_tiny_study_workers_and_table(tmp_path, small_data, monkeypatch):
    "Two workers share a tiny study; collect folds it into runs.json + steps.parquet; with only those two files no run is needed."
    monkeypatch.chdir(tmp_path)
    out, data = Path("study"), str(small_data)
    said = train_tiny(out, data)
    import altgrad.confirm as C
    from altgrad.sweep import check_run
    checks = []
    monkeypatch.setattr(C, "check_run", lambda d, cfg: checks.append(d) or check_run(d, cfg))
    specs, done = todo(TINY, out, data, ("tuning", "heldout"))
    n = 3 * 2 * (1 + 4)                                        # units x formats x (trunk + 4 regimes at x1)
    assert specs == [] and len(done) == n, (specs, sorted(done))
    assert len(set(checks)) == n and todo(TINY, out, data, ("tuning", "heldout")) == (specs, done)
    assert len(set(checks)) == n and len(checks) == n, len(checks)     # asked again: each folder was checked once
    s = out / "runs" / sorted(done)[0] / "summary.json"
    s.write_text(s.read_text() + " ")                         # a folder that changes is checked again
    assert todo(TINY, out, data, ("tuning", "heldout")) == (specs, done) and len(checks) == n + 1
    assert len(said) == n, said                               # every run trained once, by one of the two workers
    assert collect(out) == dict(runs=n, folded=n)
    table, steps = read_table(out), read_steps(out)
    fixed = read_table(FIXTURE)                               # trained by earlier code (MACHINE: which, and where)
    got, want = ({k: r["summary"]["final_val_loss"] for k, r in t.items()} for t in (table, fixed))
    if json.loads(MACHINE.read_text())["machine"] == machine():   # the fixture's kind of machine: the numerics, bit for bit
        assert got == want
        assert {k: r.get("digest") for k, r in table.items()} == {k: r.get("digest") for k, r in fixed.items()}
    else:                                                     # another CPU: the same runs, losses within LOSS_TOL
        assert got.keys() == want.keys()
        far = {k: (got[k], want[k]) for k in got if not abs(got[k] - want[k]) < LOSS_TOL}
        assert not far, f"{len(far)} runs' final losses moved by {LOSS_TOL} or more from the fixture's: {far}"
    assert set(steps["run"]) == set(table) and len(steps) == 3 * 2 * (4 + 4 * 4)   # trunks: steps 1-4, branches: 5-8
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == ["runs.parquet", "steps.parquet"]
    row = table[Spec("heldout", "E7M0", (7, 8), "eco").name]
    assert row["config"]["weight_update"] == "eco" and row["summary"]["init_step"] == 4
    assert set(row["means"]) >= {"lost_update", "stall"} and len(table["trunk-E7M0-i7-d8"]["digest"]) == 64
    shutil.rmtree(out / "runs")                               # a fresh clone: the table alone
    specs2, done2 = todo(TINY, out, data, ("tuning", "heldout"))
    assert specs2 == [] and done2 == done
    changed = dict(table); changed[row["name"]] = {**row, "config": {**row["config"], "lr": 0.5}}
    write_table(out, list(changed.values()))
    specs3, _ = todo(TINY, out, data, ("tuning", "heldout"))
    assert [s.name for s in specs3] == ["trunk-E7M0-i7-d8", "E7M0-eco-x1-i7-d8"]   # a changed config trains again (its trunk first)
    said = train_tiny(out, data)                              # the workers retrain the trunk (same digest), then the branch
    assert sorted(l.split(":")[0] for l in said) == ["[confirm] E7M0-eco-x1-i7-d8", "[confirm] trunk-E7M0-i7-d8"], said
    collect(out)
    assert read_table(out)["trunk-E7M0-i7-d8"]["digest"] == table["trunk-E7M0-i7-d8"]["digest"]
    assert read_table(out)[row["name"]]["summary"]["final_val_loss"] == row["summary"]["final_val_loss"]   # bit for bit
    wrong = dict(read_table(out)); wrong["trunk-E6M1-i7-d8"] = {**wrong["trunk-E6M1-i7-d8"], "digest": "0" * 64}
    write_table(out, [r for k, r in wrong.items() if k != "E6M1-eco-x1-i7-d8"])
    shutil.rmtree(out / "runs")
    with pytest.raises(RuntimeError, match="retrained is not the trunk its committed branches started from"):
        work(TINY, out, data, log=lambda *a, **k: None)      # (in this process: the error itself is the point)


def train_tiny(out, data) -> list:
    "TINY trained by two worker processes (`python -m altgrad.confirm work --design`) sharing `out`; the workers' lines."
    import subprocess, sys
    out = Path(out); out.mkdir(parents=True, exist_ok=True)
    (out.parent / "tiny.json").write_text(json.dumps(TINY.to_dict()))
    env = {**os.environ, "ALTGRAD_COMPILE": "never", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "altgrad.confirm", "work", "--out", str(out), "--data-dir", str(data), "--design", str(out.parent / "tiny.json")]
    ps = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    res = [p.communicate(timeout=900) for p in ps]
    assert all(p.returncode == 0 for p in ps), [e[-2000:] for _, e in res]
    return [l for o, _ in res for l in o.splitlines() if l.startswith("[confirm]")]


def test_answer_regenerates_from_fixture(tmp_path):
    "The answer of a committed tiny study is rewritten byte for byte from its table alone (no data, no training)."
    from altgrad.confirm_answer import write_answer
    for f in ("runs.parquet", "steps.parquet"): shutil.copy(FIXTURE / f, tmp_path / f)
    A = write_answer(TINY, tmp_path)
    assert A["status"] == "complete" and A["units"] == [(7, 8), (9, 8)]
    for f in ("answer.md", "study.json"): assert (tmp_path / f).read_text() == (FIXTURE / f).read_text(), f
    assert (tmp_path / "figures" / "law.png").stat().st_size > 10_000
    first = (tmp_path / "answer.md").read_text().split("\n")[2]
    assert first.startswith("**E") and "H1 (one law)" in first and "H3 (E7M0 > E6M1" in first and "H4 (ECO" in first


if __name__ == "__main__":              # make the fixture: python tests/test_confirm.py (data prepared as `small_data` does)
    import subprocess, sys, tempfile
    from altgrad.confirm_answer import write_answer
    from altgrad.data import prepare_eurlex, shared_data_dir
    work_dir = Path(tempfile.mkdtemp()); os.chdir(work_dir)
    data = work_dir / "data" / "eurlex"
    prepare_eurlex(data, source=shared_data_dir() / "eurlex", max_docs=300, progress=False)   # = conftest's small_data
    train_tiny(Path("study"), data); collect("study")
    FIXTURE.mkdir(parents=True, exist_ok=True)
    for f in ("runs.parquet", "steps.parquet"): shutil.copy(Path("study") / f, FIXTURE / f)
    (FIXTURE / "runs.json").unlink(missing_ok=True)
    write_answer(TINY, FIXTURE); shutil.rmtree(FIXTURE / "figures")
    here = Path(__file__).resolve().parent
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "../altgrad"], cwd=here, capture_output=True, text=True).stdout
    MACHINE.write_text(json.dumps(dict(machine=machine(), code=commit + ("+changes" if dirty.strip() else ""),
                                       data=json.loads((data / "meta.json").read_text())["splits"]), indent=1) + "\n")
    print(f"wrote {FIXTURE}")
