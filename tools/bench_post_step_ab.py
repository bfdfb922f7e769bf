"""A/B in one process: trainers of the study preset (E4M3), identical configs, one stepping with the old quant_post_step
(grid.py + step.py of commit OLD, loaded as a second package `altgrad_old`), one with the new; interleaved; median step
time and median post-step time of each, and whether both trained identically (state and every logged value).

    PYTHONPATH=. python tools/bench_post_step_ab.py REGIMES [STEPS] [OLD]   (REGIMES: plain,fp32,nearest,...)
"""
import json, math, os, re, statistics, subprocess, sys, tempfile, time
import torch
from pathlib import Path
_old = sys.argv[3] if len(sys.argv) > 3 else "cb0d135"
_pkg = Path(tempfile.mkdtemp()) / "altgrad_old"; _pkg.mkdir()
(_pkg / "__init__.py").write_text("")
for _f in ("grid", "step"):
    _src = subprocess.run(["git", "show", f"{_old}:altgrad/{_f}.py"], capture_output=True, text=True, check=True).stdout
    _src = re.sub(r"^from \.grid import", "from altgrad_old.grid import", _src, flags=re.M)
    (_pkg / f"{_f}.py").write_text(re.sub(r"^from \.([a-z_]+) import", r"from altgrad.\1 import", _src, flags=re.M))
sys.path.insert(0, str(_pkg.parent))
from altgrad.config import load_config
from altgrad.trainer import Trainer
from altgrad.regimes import UPDATE_REGIMES
import altgrad.step as new_step
import altgrad_old.step as old_step
from altgrad.bench import _bench_data
data = _bench_data(tempfile.mkdtemp())
regimes = sys.argv[1].split(",")
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
post = {}
trainers = {}
for reg in regimes:
    ov = {} if reg in ("fp32", "plain") else UPDATE_REGIMES[reg].overrides()
    for ver in (("plain",) if reg == "plain" else ("old", "new")):
        t = Trainer(load_config("study", data_dir=data, out_dir=tempfile.mkdtemp(),
                                fmt=None if reg == "plain" else "E4M3", shadow=False, max_steps=steps + 5,
                                wandb_mode="disabled", **ov), progress=False)
        if ver == "old": t.grid_step = old_step.GridStep(t.model, t.optimizer, t.grid_step.spec)
        trainers[f"{reg}/{ver}"] = t
# per-trainer post-step timing: each module's quant_post_step is wrapped; the time goes to the trainer stepping now
cur = [None]
for mod in (old_step, new_step):
    def w(*a, _f=mod.quant_post_step, **k):
        t0 = time.perf_counter(); r = _f(*a, **k)
        post.setdefault(cur[0], []).append(time.perf_counter() - t0); return r
    mod.quant_post_step = w                    # GridStep.step looks the name up in its own module
times, logs, names = {k: [] for k in trainers}, {}, list(trainers)
for i in range(3 + steps):                     # 3 warm-up rounds, the order rotated every round
    j = i % len(names)
    for k in names[j:] + names[:j]:
        cur[0] = k
        mets = trainers[k].train_step()
        logs.setdefault(k, []).append({a: b for a, b in mets.items() if not a.startswith(("perf/", "time"))})
        if i >= 3: times[k].append(mets["perf/step_time"])
med = {k: statistics.median(v) for k, v in times.items()}
pmed = {k: statistics.median(v[3:]) for k, v in post.items()}

def same(a, b):
    "Equal, NaN equal to NaN, tensors, dicts and lists compared element by element."
    if torch.is_tensor(a):
        return torch.equal(a, b) or (torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))
    if isinstance(a, dict): return a.keys() == b.keys() and all(same(a[x], b[x]) for x in a)
    if isinstance(a, (list, tuple)): return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float): return (math.isnan(a) and math.isnan(b)) or a == b
    return a == b

ident = {}
for reg in regimes:
    if reg == "plain": continue
    o, n = trainers[f"{reg}/old"], trainers[f"{reg}/new"]
    st = same(o.model.state_dict(), n.model.state_dict()) and same(o.optimizer.state_dict(), n.optimizer.state_dict())
    lo, ln = logs[f"{reg}/old"], logs[f"{reg}/new"]
    ident[reg] = dict(state=st, logged=len(lo) == len(ln) and all(same(a, b) for a, b in zip(lo, ln)),
                      logged_keys=len(lo[-1]))
print(json.dumps(dict(load=os.getloadavg(), step_time=med, post_step_time=pmed, identical=ident), indent=1))
