"""The seeds' GPU experiment (issue 20) inside one lease of a GPU machine.

The reference and every format run of the `gpu` preset, in the seeds' order (`SEED_ORDER`: the BF16-autocast reference,
then E5M2, E3M4, E1M6, E7M0, E4M3 with FP32 master weights (E0M7 is E1M6's grid scaled by 2^-1: its run is E1M6's, as
`altgrad-sweep` reuses it) and the FP32 shadow, then E7M0 and E5M2 with the
weights on the grid under nearest, stochastic and kahan), each in its own process, at most `--jobs` at a time, into one
sweep folder (`OUT/<name>/run`, the reference in `OUT/_reference/`, as `altgrad-sweep` lays it out). A run still going
at `--deadline` seconds is stopped with SIGTERM (it checkpoints; the machine keeps nothing, so it counts as unfinished).
Finished runs are rewritten in the compact run format with per-layer columns and histograms (the write-up runs'), and
their checkpoints are removed. `OUT/experiment.json` records every run's state, seconds and step time.

The write-ups are rendered afterwards by the main job (`papermill nbs/run_format.ipynb ... -p preset gpu`), which reuses
the finished runs. Usage: `python tools/gpu_experiment.py --out outputs/gpu --data-dir D --jobs 8 --deadline 300`.
"""
import argparse, json, os, shutil, signal, subprocess, sys, time
from pathlib import Path

SEED_ORDER = [("reference", None, "fp32", None)] + [(f, f, "fp32", None) for f in ("E5M2", "E3M4", "E1M6", "E7M0", "E4M3")] \
    + [(f"{f}-{r}", f, "format", r) for f in ("E7M0", "E5M2") for r in ("nearest", "stochastic", "kahan")]

def child(out: str, data_dir: str, preset: str, name: str):
    "Train one run (in its own process)."
    from altgrad.sweep import reference_run, format_config, train
    from altgrad.config import load_config
    _, fmt, mw, rule = next(s for s in SEED_ORDER if s[0] == name)
    steps = load_config(preset).max_steps
    if fmt is None: reference_run(out, preset, 42, steps, data_dir, "disabled")
    else:
        cfg = format_config(fmt, out, preset=preset, seed=42, data_dir=data_dir, tag=rule or "", master_weights=mw,
                            wandb_mode="disabled", **({"weight_update": rule} if rule else {}))
        train(cfg)

def run_dir(out: Path, preset: str, name: str) -> Path:
    if name != "reference": return out / name / "run"
    from altgrad.sweep import reference_dir
    from altgrad.config import load_config
    return reference_dir(out, preset, 42, load_config(preset).max_steps)

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="outputs/gpu"); p.add_argument("--data-dir", required=True)
    p.add_argument("--preset", default="gpu"); p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--deadline", type=float, default=300, help="seconds from start after which running runs are stopped")
    p.add_argument("--no-start", type=float, default=120, help="start no run this many seconds before the deadline")
    p.add_argument("--only", help="comma-separated run names (default: all, in the seeds' order)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child: child(a.out, a.data_dir, a.preset, a.child); return 0
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    names = [s[0] for s in SEED_ORDER if not a.only or s[0] in a.only.split(",")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    t0, queue, running, state, stopped = time.time(), list(names), {}, {}, False
    while running or (queue and time.time() - t0 < a.deadline - a.no_start):
        while queue and len(running) < a.jobs and time.time() - t0 < a.deadline - a.no_start:
            n = queue.pop(0); log = open(out / f"{n}.log", "w")
            running[n] = (subprocess.Popen([sys.executable, __file__, "--out", a.out, "--data-dir", a.data_dir, "--preset", a.preset,
                                            "--child", n], env=env, stdout=log, stderr=subprocess.STDOUT), time.time())
            print(f"[gpu] start {n} at {time.time() - t0:.0f} s", flush=True)
        if time.time() - t0 >= a.deadline and not stopped:
            stopped = True
            for n, (pr, _) in running.items(): pr.send_signal(signal.SIGTERM)
        for n, (pr, ts) in list(running.items()):
            if pr.poll() is None: continue
            state[n] = dict(state="finished" if pr.returncode == 0 else f"failed (exit {pr.returncode})", seconds=round(time.time() - ts, 1))
            print(f"[gpu] {n}: {state[n]}", flush=True); del running[n]
        time.sleep(1)
    for n in queue: state[n] = dict(state="not started (deadline)")
    from altgrad.tracking import compact_run
    for n in names:
        d = run_dir(out, a.preset, n)
        s = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
        done = s.get("stopped_reason") not in (None, "interrupted")     # max_steps, or the NaN stop of the seeds' failure study
        if state.get(n, {}).get("state") == "finished" and not done: state[n]["state"] = "exited without finishing"
        state.setdefault(n, {}).update({k: s.get(k) for k in ("final_step", "max_steps", "stopped_reason", "final_val_loss", "step_time",
                                                                 "tokens_per_sec", "device", "gpu", "torch", "cuda")})
        if done:
            compact_run(d, keep_histograms=True)
            shutil.rmtree(d / "checkpoints", ignore_errors=True); shutil.rmtree(d / "wandb", ignore_errors=True)
    (out / "experiment.json").write_text(json.dumps(dict(preset=a.preset, jobs=a.jobs, deadline_s=a.deadline,
                                                         wall_s=round(time.time() - t0, 1), runs=state), indent=1))
    print(json.dumps(state, indent=1))
    return 0

if __name__ == "__main__": sys.exit(main())
