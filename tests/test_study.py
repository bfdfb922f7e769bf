"System tests of the decisive study (planned by altgrad.study, written up by altgrad.answer, run by altgrad.study_cli) on the smoke preset: two shards plus --collect, the CLI, resume, papermill."
import contextlib, io, json, os, shutil, subprocess, sys, time
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
# 2 formats x 2 regimes (+ the fp32-master regime, needed for the recovered fraction); tuning seed 42 at one multiplier,
# held-out seeds 43, 44
ARGS = ["--preset", "smoke", "--formats", "E4M3,E7M0", "--regimes", "nearest,kahan", "--tuning-seeds", "42", "--heldout-seeds", "43,44",
        "--steps", "6", "--lr-mults", "1", "--max-extensions", "0"]
N_RUNS = 2 * 3 + 2 * (2 + 2 * 3)      # tuning: formats x regimes; held-out seeds: references (FP32, BF16) + formats x regimes


@pytest.fixture(scope="module", autouse=True)
def eager_kernels():
    "Smoke-sized tensors: eager quantization kernels (ALTGRAD_COMPILE=never, same numbers) save each process the torch.compile warm-up."
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALTGRAD_COMPILE", "never")
        yield


def cli(*args):
    "The console script (or, before `pip install -e .` knows it, the same entry point through python)."
    exe = shutil.which("altgrad-study")
    cmd = [exe] if exe else [sys.executable, "-c", "import sys; from altgrad.study_cli import study_cli; sys.exit(study_cli(sys.argv[1:]))"]
    return subprocess.run(cmd + [str(a) for a in args], cwd=ROOT, env={**os.environ}, capture_output=True, text=True, timeout=900)


def inproc(*args) -> tuple[int, str]:
    "`study_cli` in this process (no second import of torch, no second kernel compile); (exit code, stdout + stderr)."
    from altgrad.study_cli import study_cli
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf): rc = study_cli([str(a) for a in args])
    return rc, buf.getvalue()


def names(folder) -> set:
    return {p.name for p in (Path(folder) / "runs").iterdir()} if (Path(folder) / "runs").is_dir() else set()


def check_numbers(out: Path) -> dict:
    "Every run number in study.json equals what its run folder says; every cell statistic follows from them."
    from altgrad.runs import load_run, final_loss
    st = json.loads((out / "study.json").read_text())
    for name, rec in st["runs"].items():
        run = load_run(out / rec["dir"])
        assert rec["final_val_loss"] == final_loss(run), name
        if rec["final_val_loss"] is not None: assert rec["final_val_loss"] == run.last("val/loss") == run.summary["final_val_loss"]
    loss = lambda d: st["runs"][Path(d).name]["final_val_loss"]
    mean = lambda xs: sum(xs) / len(xs)
    for f, per in st["cells"].items():
        ctrl = [loss(d) for d in per["nearest"]["runs"]]
        for r, c in per.items():
            L = [loss(d) for d in c["runs"]]
            ok = [x for x in L if x is not None]
            assert c["loss"]["n"] == len(ok) and (not ok or c["loss"]["mean"] == pytest.approx(mean(ok)))
            if "benefit" in c:
                d = [a - b for a, b in zip(ctrl, L) if a is not None and b is not None]
                assert c["benefit"]["n"] == len(d) and (not d or c["benefit"]["mean"] == pytest.approx(mean(d)))
    md = (out / "answer.md").read_text()
    assert st["answer"] in md and md.index(st["answer"]) < md.index("## Results per format × regime")
    for f in st["plan"]["formats"]: assert f"| {f} |" in md
    for fig in st["figures"].values(): assert (out / fig).exists()
    return st


@pytest.fixture(scope="module")
def study(tmp_path_factory, small_data):
    """The smoke study trained as two shards sharing one folder (shard 0, shard 1, shard 0 again: a shard stops while the
    other's tuning runs are missing) and merged into another with --collect; the later tests reuse that folder."""
    root = tmp_path_factory.mktemp("study")
    shared, logs = root / "shared", []
    for i in (0, 1, 0):
        rc, log = inproc(*ARGS, "--data-dir", small_data, "--out", shared, "--shard", f"{i}/2")
        assert rc == 0, log[-3000:]
        logs.append(log)
    out = root / "study"
    rc, log = inproc(*ARGS, "--data-dir", small_data, "--out", out, "--collect", shared)
    assert rc == 0, log[-3000:]
    return dict(out=out, shared=shared, data=small_data, logs=logs, collect_log=log)


def test_shards_and_collect(study):
    import re
    out, shared = study["out"], study["shared"]
    trained = [sum(int(n) for n in re.findall(r"(\d+) trained", log)) for log in study["logs"]]
    assert all(trained[:2]) and sum(trained) == len(names(shared)) == N_RUNS, trained      # every run trained once, by one shard
    assert not (shared / "answer.md").exists() and "shard 0/2 done" in study["logs"][-1]
    assert names(out) == names(shared) and f"0 already here, {N_RUNS} collected" in study["collect_log"], study["collect_log"][-2000:]
    for n in names(out):
        d = out / "runs" / n
        assert (d / "config.yaml").exists() and (d / "summary.json").exists() and (d / "metrics.parquet").exists()
        assert not any(d.glob("checkpoints*")), "checkpoints are removed once a run finished"
    st = check_numbers(out)
    assert st["complete"] and st["plan"]["regimes"] == ["fp32", "nearest", "kahan"] and st["plan"]["seeds"] == [42, 43, 44]
    assert set(st["references"]) == {"fp32", "bf16"}
    import yaml
    assert yaml.safe_load((out / "runs" / "ref-bf16-s43" / "config.yaml").read_text())["precision"] == "bf16"
    k = yaml.safe_load((out / "runs" / "E4M3-kahan-x1-s43" / "config.yaml").read_text())
    assert (k["master_weights"], k["weight_update"], k["optimizer"], k["seed"], k["fmt"]) == ("format", "kahan", "adamw", 43, "E4M3")


def test_cli_reuses_and_report_only(study):
    out, data = study["out"], study["data"]
    # a run whose config no longer matches is trained again, saying why; every other run is reused
    cfg = out / "runs" / "ref-fp32-s43" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("\nlr: 0.001\n", "\nlr: 0.002\n"))
    r = cli(*ARGS, "--data-dir", data, "--out", out)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "ref-fp32-s43: not reusing" in r.stdout and "lr: 0.002 -> 0.001" in r.stdout, r.stdout[-2000:]
    assert f"{N_RUNS - 1} reused, 1 trained" in r.stdout
    # a second invocation reuses every run
    r = cli(*ARGS, "--data-dir", data, "--out", out)
    assert r.returncode == 0 and f"{N_RUNS} reused, 0 trained" in r.stdout and "not reusing" not in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    check_numbers(out)
    md, js = (out / "answer.md").read_text(), (out / "study.json").read_text()
    # regenerated from the run folders alone: byte-identical
    for p in ("answer.md", "study.json"): (out / p).unlink()
    r = cli("--out", out, "--report-only")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "answer.md").read_text() == md and (out / "study.json").read_text() == js
    assert "altgrad-study --out" in md and "--report-only" in md and "--preset smoke" in md


def test_papermill_reuses(study):
    import papermill as pm
    out, data = study["out"], study["data"]
    md = (out / "answer.md").read_text()
    nb_out = out.parent / "run_study.ipynb"
    pm.execute_notebook(str(ROOT / "nbs" / "run_study.ipynb"), str(nb_out), cwd=str(ROOT), kernel_name="python3", progress_bar=False,
                        parameters=dict(preset="smoke", out=str(out), formats="E4M3,E7M0", regimes="nearest,kahan", tuning_seeds="42",
                                        heldout_seeds="43,44", steps=6, lr_mults="1", max_extensions=0, data_dir=str(data)))
    text = "".join("".join(o.get("text", "")) + json.dumps(o.get("data", {})) for c in json.loads(nb_out.read_text())["cells"]
                   for o in c.get("outputs", []))
    assert "'trained': 0" in text and f"'reused': {N_RUNS}" in text, text[-2000:]
    assert "**Answer.**" in text and "image/png" in text
    assert (out / "answer.md").read_text() == md


def test_interrupted_run_resumes(study, tmp_path, monkeypatch):
    """An interrupted run of the same config (a step checkpoint, summary `stopped_reason='interrupted'`: what the trainer leaves
    at SIGINT/SIGTERM) is resumed from its checkpoint, never retrained or deleted, and ends where the uninterrupted run ended;
    an interrupted study says in one line how to resume."""
    import altgrad.study as S
    from altgrad.runs import load_run, final_loss
    out, data, name = tmp_path / "study", study["data"], "E4M3-kahan-x1-s43"
    shutil.copytree(study["out"], out, ignore=shutil.ignore_patterns("answer.md", "study.json", "figures"))
    want = final_loss(load_run(out / "runs" / name))
    shutil.rmtree(out / "runs" / name)
    plan = S.decisive_plan("smoke", "E4M3,E7M0", "nearest,kahan", S.make_protocol("42", "43,44", "1", 0), 6)
    cfg = S.spec_config(plan, S.format_spec("E4M3", "kahan", 43, 1.0), out, data)
    t = S.Trainer(cfg, progress=False); t.fit(until=3); t.save_checkpoint()
    sj = out / "runs" / name / "summary.json"
    sj.write_text(json.dumps({**json.loads(sj.read_text()), "stopped_reason": "interrupted"}))
    assert S.resumable(out / "runs" / name, cfg)
    rc, log = inproc(*ARGS, "--data-dir", data, "--out", out)
    assert rc == 0 and f"{name}: resuming the interrupted run" in log and f"{N_RUNS - 1} reused, 1 trained" in log, log[-3000:]
    run = load_run(out / "runs" / name)
    assert final_loss(run) == want and run.summary["stopped_reason"] == "max_steps", (final_loss(run), want)
    assert not any((out / "runs" / name).glob("checkpoints*")) and not (out / "runs" / name / "_previous").exists()
    # an interrupt during the study: one line on how to resume, exit code 130, the finished runs kept
    shutil.rmtree(out / "runs" / name)
    def interrupted(*a, **k): raise KeyboardInterrupt
    monkeypatch.setattr(S, "train_spec", interrupted)
    rc, log = inproc(*ARGS, "--data-dir", data, "--out", out)
    assert rc == 130 and f"interrupted during {name}" in log and "rerun the same command to resume" in log, log[-2000:]
    assert len(names(out)) == N_RUNS - 1


# --- the decisive protocol: a committed fixture of synthetic run folders, regenerated by --report-only ---
FIXTURE = ROOT / "tests" / "fixtures" / "study-decisive"
FIXTURE_MISSING = ["E5M2-nearest-x3-s5", "ref-bf16-x3-s4"]          # held-out runs removed for the incomplete case


def fixture_study(out):
    "The fixture's synthetic study: 3 formats x 3 regimes, tuning seeds 1,2 (one grid extension allowed), held-out seeds 3,4,5."
    import math, zlib
    from altgrad.study import make_protocol, decisive_plan
    from altgrad.testing import fake_decisive_study
    proto = make_protocol("1,2", "3,4,5", max_extensions=1)
    plan = decisive_plan("smoke", "E3M4,E5M2,E7M0", "fp32,nearest,stochastic", proto)
    stall_at = {"E3M4": 0.2, "E5M2": 0.45, "E7M0": 0.9}
    stall = lambda f, m: min(1.0, stall_at[f] / m ** 0.5)
    def loss(f, r, m, s):          # a bowl in log(m) (FP32 master weights prefer x3); nearest pays for its stall, stochastic half of it
        noise = 0.04 * (zlib.crc32(f"{f}{r}{m}{s}".encode()) % 1000) / 1000
        base = 5.0 + 0.1 * (math.log(m) - (math.log(3) if r == "fp32" else 0.0)) ** 2 + noise
        if f is None: return base - 0.1
        return base + {"fp32": 0.0, "nearest": 0.8, "stochastic": 0.4}[r] * stall(f, m) + (1.1 if f == "E7M0" else 0.0)
    return fake_decisive_study(out, plan, proto, loss, stall, unigram=6.0)


def make_fixture():
    "Regenerate the committed fixture (run once by hand: `python tests/test_study.py`)."
    if FIXTURE.exists(): shutil.rmtree(FIXTURE)
    fixture_study(FIXTURE)
    assert study_cli_quiet("--out", FIXTURE, "--report-only") == 0
    miss = FIXTURE.parent / "study-decisive-missing"
    tmp = FIXTURE.parent / "_tmp"
    shutil.rmtree(FIXTURE / "figures")                                  # regenerated by every report; not committed
    shutil.copytree(FIXTURE, tmp)
    for n in FIXTURE_MISSING: shutil.rmtree(tmp / "runs" / n)
    assert study_cli_quiet("--out", tmp, "--report-only") == 0
    miss.mkdir(exist_ok=True)
    for p in ("answer.md", "study.json"): shutil.copy(tmp / p, miss / p)
    shutil.rmtree(tmp)


def study_cli_quiet(*args) -> int:
    return inproc(*args)[0]


def test_decisive_fixture_report_only(tmp_path):
    "--report-only reproduces the committed decisive fixture's answer.md and study.json byte for byte, also with runs missing."
    assert FIXTURE.is_dir() and (FIXTURE / "study_inputs.json").exists()
    size = sum(p.stat().st_size for p in FIXTURE.parent.rglob("*") if p.is_file())
    assert size < 400_000, size
    out = tmp_path / "study-decisive"
    shutil.copytree(FIXTURE, out, ignore=shutil.ignore_patterns("answer.md", "study.json", "figures"))
    rc, log = inproc("--out", out, "--report-only")
    assert rc == 0, log[-2000:]
    for p in ("answer.md", "study.json"): assert (out / p).read_bytes() == (FIXTURE / p).read_bytes(), p
    md, st = (out / "answer.md").read_text(), json.loads((out / "study.json").read_text())
    assert st["complete"] and st["design"] == "decisive" and md.splitlines()[2].startswith("**Answer.** **")
    assert "95% CI" in md.splitlines()[2] and "R² =" in md.splitlines()[2] and "detectable at 80% power" in md.splitlines()[2]
    assert "## Formats against each other (paired by seed)" in md and "Holm" in md and "E7M0 fails outright" in md
    assert (out / "figures" / "law.png").exists() and "![law](figures/law.png)" in md
    for n in FIXTURE_MISSING: shutil.rmtree(out / "runs" / n)
    rc, log = inproc("--out", out, "--report-only")
    assert rc == 0, log[-2000:]
    for p in ("answer.md", "study.json"):
        assert (out / p).read_bytes() == (FIXTURE.parent / "study-decisive-missing" / p).read_bytes(), p
    md = (out / "answer.md").read_text()
    assert "claims nothing" in md and all(n in md for n in FIXTURE_MISSING) and "benefits most, from" not in md
    # a missing tuning run: the rates cannot be chosen, so the held-out runs are not even planned
    shutil.rmtree(out / "runs" / "E3M4-nearest-x1-s1")
    assert inproc("--out", out, "--report-only")[0] == 0
    md = (out / "answer.md").read_text()
    assert "claims nothing" in md and "the learning-rate choice of nearest" in md and "E3M4-nearest-x1-s1" in md, md[:1500]


if __name__ == "__main__":
    make_fixture()


def test_decisive_trains_in_shards_and_resumes(study, tmp_path):
    """A tiny decisive study trained for real (smoke preset): two shards share one folder, each stops when the other's tuning
    runs are missing, a rerun continues; the unsharded command then reuses every run and writes the answer."""
    import re
    args = ["--design", "decisive", "--preset", "smoke", "--formats", "E4M3", "--regimes", "nearest", "--tuning-seeds", "42",
            "--heldout-seeds", "43,44", "--steps", "6", "--lr-mults", "1,3", "--max-extensions", "0", "--data-dir", study["data"]]
    out = tmp_path / "decisive"
    trained = lambda log: sum(int(n) for n in re.findall(r"(\d+) trained", log))
    logs = [inproc(*args, "--out", out, "--shard", f"{i}/2") for i in (0, 1, 0)]
    assert all(rc == 0 for rc, _ in logs), [log[-1500:] for _, log in logs]
    inputs = json.loads((out / "study_inputs.json").read_text())
    choice = inputs["lr_choice"]                     # the protocol is written before any run; the choice before the seed phase
    assert inputs["protocol"]["tuning_seeds"] == [42] and choice is not None and inputs["vocab"]["size"] and inputs["analysis"]
    rc, log = inproc(*args, "--out", out)
    assert rc == 0 and re.search(r"\b0 trained", log) and "resuming" not in log, log[-2000:]
    st = json.loads((out / "study.json").read_text())
    assert st["complete"] and len(names(out)) == 2 * 2 + 2 * (2 + 2) == len(st["runs"])          # tuning + held-out (refs + cells)
    assert sum(map(trained, [l for _, l in logs])) == len(names(out))
    assert all(g["status"] in ("bracketed", "unbracketed") for g in st["lr_choice"]["grids"].values())
    assert json.loads((out / "study_inputs.json").read_text())["lr_choice"]["mults"] == st["lr_choice"]["mults"] == choice["mults"]
    # the budget from step times measured by short runs of each regime and reference (4 runs of 8 steps)
    rc, log = inproc(*args, "--out", tmp_path / "est", "--estimate")
    assert rc == 0 and "12 runs without grid extensions, 12 if every regime's grid" in log and "reference_bf16" in log, log[-1500:]
    # the protocol is fixed: the same folder refuses other held-out seeds
    rc, log = inproc(*[a if a != "43,44" else "43,45" for a in args], "--out", out)
    assert rc == 2 and "fixed another protocol" in log, log[-1500:]


def test_shards_share_work(small_data, tmp_path):
    """Two shard processes on one folder with --share-work (what the decisive study runs), the second started once the first
    has finished a run: each trains the other's unclaimed runs when its own are done and waits for the ones still training,
    so neither stops to wait for the other's tuning runs, the first trains runs of the second's share, and no run is
    trained twice; the unsharded
    command then reuses every run. A finished run that no longer matches its config is moved aside, never deleted."""
    import re, yaml
    args = ["--design", "decisive", "--preset", "smoke", "--formats", "E4M3", "--regimes", "nearest", "--tuning-seeds", "42",
            "--heldout-seeds", "43,44", "--steps", "6", "--lr-mults", "1,3", "--max-extensions", "0", "--data-dir", small_data]
    out = tmp_path / "shared"
    exe = [sys.executable, "-c", "import sys; from altgrad.study_cli import study_cli; sys.exit(study_cli(sys.argv[1:]))"]
    logs = [tmp_path / f"shard{i}.log" for i in (0, 1)]
    start = lambda i: subprocess.Popen(exe + [str(a) for a in args] + ["--out", str(out), "--shard", f"{i}/2", "--share-work"],
                                       cwd=ROOT, stdout=open(logs[i], "w"), stderr=subprocess.STDOUT)
    procs = [start(0)]
    try:           # shard 1 starts once shard 0 has finished a run: shard 0 runs out of its own work first and must help
        t0 = time.time()
        while not list((out / "runs").glob("*/summary.json")) and procs[0].poll() is None and time.time() - t0 < 600: time.sleep(0.2)
        procs.append(start(1))
        for p in procs: p.wait(timeout=900)
    finally:
        for p in procs: p.kill()
    text = [l.read_text() for l in logs]
    assert [p.returncode for p in procs] == [0, 0] and all(f"shard {i}/2 done" in t for i, t in enumerate(text)), [t[-1500:] for t in text]
    trained = [sum(int(n) for n in re.findall(r"(\d+) trained", t)) for t in text]
    helped = [sum(int(n) for n in re.findall(r"(\d+) of them for other shards", t)) for t in text]
    assert sum(trained) == len(names(out)) == 2 * 2 + 2 * (2 + 2) and sum(helped) > 0, (trained, helped, sorted(names(out)))
    rc, log = inproc(*args, "--out", out)
    assert rc == 0 and re.search(r"\b0 trained", log) and json.loads((out / "study.json").read_text())["complete"], log[-2000:]
    rc, log = inproc(*args, "--out", out, "--share-work")
    assert rc == 2 and "--share-work goes with --shard" in log, log[-500:]
    # a finished run whose config no longer matches (here: its lr edited) is retrained, and the old one kept in _previous/
    run = next(p for p in sorted((out / "runs").iterdir()) if p.name.startswith("ref-fp32-"))
    cfg = yaml.safe_load((run / "config.yaml").read_text()); cfg["lr"] *= 2; (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    old = (run / "summary.json").read_bytes()
    rc, log = inproc(*args, "--out", out)
    assert rc == 0 and re.search(r"\b1 trained", log) and "moves to its _previous/ folder" in log, log[-2000:]
    kept = list((run / "_previous").glob("*/summary.json"))
    assert len(kept) == 1 and kept[0].read_bytes() == old and (run / "summary.json").exists(), kept


def test_no_import_cycle():
    "The planner imports neither the write-up nor the command line; the write-up imports the planner, the command line both."
    code = ("import sys, altgrad.study; a = sorted(m for m in ('altgrad.answer', 'altgrad.study_cli') if m in sys.modules); "
            "import altgrad.answer; b = 'altgrad.study_cli' in sys.modules; import altgrad.study_cli as C; print(a, b, C.report_study.__module__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "[] False altgrad.answer", r.stdout + r.stderr[-2000:]
