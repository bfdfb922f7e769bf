"""The requirements' GPU experiment inside one lease of a GPU machine.

The runs, in the requirements' order: the reference (BF16 autocast on CUDA); every format of `altgrad.sweep.REQUIRED_ORDER` with
FP32 master weights and the FP32 shadow, less a format grid-equivalent to an earlier one (E0M7 is E1M6's grid scaled by
2^-1: its run is E1M6's, as `altgrad-sweep` reuses it); then E7M0 and E5M2 with the weights on the grid under nearest,
stochastic and kahan. Each run is one process of `altgrad.pool.run_pool` (`altgrad.sweep.sweep_job`, the process body of
`altgrad-sweep --jobs`), at most `--jobs` at a time. Folders: the reference in `OUT/_reference/<preset>-s42-n<steps>/`,
a format in `OUT/<fmt>/run`, a landing in `OUT/<fmt>-<landing>/run` (`altgrad-sweep --update-regimes` would instead
write `OUT/<regime>/<fmt>/run`); each run's log in `OUT/.jobs/<name>.log`.

No run starts in the last `--no-start` seconds before `--deadline`; at the deadline every running run gets SIGTERM (it
checkpoints and exits; the machine keeps nothing, so it counts as unfinished), and a run still there `--grace` seconds
later is killed. Finished runs are rewritten in the compact run format with per-layer columns and histograms (the
write-up runs') and lose their checkpoints. `OUT/experiment.json` records every run's state, seconds and step time.

The write-ups are rendered afterwards by the main job (`papermill nbs/run_format.ipynb ... -p preset gpu`), which reuses
the finished runs. Usage: `python tools/gpu_experiment.py --out outputs/gpu --data-dir D --jobs 8 --deadline 300`.
"""
import argparse, json, os, shutil, signal, sys, threading, time
from pathlib import Path

from altgrad.config import load_config
from altgrad.formats import grid_equivalent
from altgrad.pool import Job, JobsInterrupted, job_env, run_pool
from altgrad.sweep import REQUIRED_ORDER, _spec, reference_dir, run_name
from altgrad.tracking import compact_run

ON_GRID_FORMATS, ON_GRID_LANDINGS = ("E7M0", "E5M2"), ("nearest", "stochastic", "kahan")


def distinct_formats(order=REQUIRED_ORDER) -> list:
    "The formats of `order` less those grid-equivalent to an earlier one (trained once, as the sweep does)."
    return [f for i, f in enumerate(order) if not any(grid_equivalent(f, g) is not None for g in order[:i])]


def experiment(preset: str) -> list:
    "(name, format, master weights, landing) of every run, in the requirements' order."
    return ([("reference", None, "fp32", None)] + [(f, f, "fp32", None) for f in distinct_formats()]
            + [(run_name(f, r), f, "format", r) for f in ON_GRID_FORMATS for r in ON_GRID_LANDINGS])


def job(out: Path, data_dir: str, preset: str, run) -> Job:
    "One run as a process of the pool: `sweep_job` with its spec (the reference, or a format run without write-up)."
    name, fmt, mw, landing = run
    common = dict(preset=preset, steps=load_config(preset).max_steps, seed=42, interventions=False, data_dir=data_dir,
                  wandb_mode="disabled", master_weights=mw, stop_on_nan=True)
    ov = {"weight_update": landing} if landing else {}
    spec = (_spec("reference", "reference", out, common, ov) if fmt is None else
            _spec("train", name, out, common, ov, fmt=fmt, tag=landing or ""))
    cmd = [sys.executable, "-c", "import json, sys; from altgrad.sweep import sweep_job; sys.exit(sweep_job(json.loads(sys.argv[1])))",
           json.dumps(spec)]
    return Job(name, cmd, out / ".jobs" / f"{name}.log")


def run_dir(out: Path, preset: str, name: str) -> Path:
    return reference_dir(out, preset, 42, load_config(preset).max_steps) if name == "reference" else out / name / "run"


def stop_at(deadline: float, grace: float) -> list:
    "Timers: SIGTERM to this process at `deadline` s (the pool sends it on to every run), then twice more `grace` s later (SIGKILL)."
    ts = [threading.Timer(t, os.kill, (os.getpid(), signal.SIGTERM)) for t in (deadline, deadline + grace, deadline + grace + 1)]
    for t in ts: t.daemon = True; t.start()
    return ts


def state_of(rc) -> str:
    "A run's state from its exit code (None: it never started; 130/143, or killed by a signal: the deadline stopped it)."
    if rc is None: return "not started (deadline)"
    return "finished" if rc == 0 else "stopped at the deadline" if rc in (130, 143) or rc < 0 else f"failed (exit {rc})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="outputs/gpu"); p.add_argument("--data-dir", required=True)
    p.add_argument("--preset", default="gpu"); p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--deadline", type=float, default=300, help="seconds from start after which running runs are stopped")
    p.add_argument("--no-start", type=float, default=120, help="start no run this many seconds before the deadline")
    p.add_argument("--grace", type=float, default=60, help="seconds a stopped run has to checkpoint before it is killed")
    p.add_argument("--only", help="comma-separated run names (default: all, in the requirements' order)")
    a = p.parse_args(argv)
    out, t0 = Path(a.out), time.time()
    out.mkdir(parents=True, exist_ok=True)
    runs = [r for r in experiment(a.preset) if not a.only or r[0] in a.only.split(",")]
    jobs = [job(out, a.data_dir, a.preset, r) for r in runs]
    timers = stop_at(a.deadline, a.grace)
    try: rcs = run_pool(jobs, a.jobs, job_env(False, {**os.environ, "WANDB_MODE": "disabled"}), prefix="[gpu]",
                        until=t0 + a.deadline - a.no_start)
    except JobsInterrupted as e:
        rcs = e.rcs; print(f"[gpu] deadline at {time.time() - t0:.0f} s: the running runs were stopped", flush=True)
    for t in timers: t.cancel()
    state = {}
    for name, *_ in runs:
        d = run_dir(out, a.preset, name)
        s = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
        done = s.get("stopped_reason") not in (None, "interrupted")     # max_steps, or the NaN stop of the requirements' failure study
        st = state_of(rcs.get(name))
        if st == "finished" and not done: st = "exited without finishing"
        state[name] = dict(state=st, **{k: s.get(k) for k in ("final_step", "max_steps", "stopped_reason", "final_val_loss", "step_time",
                                                               "tokens_per_sec", "device", "gpu", "torch", "cuda")})
        if done:
            compact_run(d, keep_histograms=True)
            for c in [*d.glob("checkpoints*"), d / "wandb"]: shutil.rmtree(c, ignore_errors=True)
    (out / "experiment.json").write_text(json.dumps(dict(preset=a.preset, jobs=a.jobs, deadline_s=a.deadline,
                                                         wall_s=round(time.time() - t0, 1), runs=state), indent=1))
    print(json.dumps(state, indent=1))
    return 0


if __name__ == "__main__": sys.exit(main())
