"""Loss drift of compiled runs (`compile=on`) against eager ones, with the plain model as the control.

For each format (default: plain, i.e. no format, and E4M3 with FP32 master weights) one eager and one compiled trainer of
a preset train the same steps from the same seed on the same batches; the tool writes both training-loss curves and, per
format, the step of the first difference, the largest |compiled - eager| and the final one. The 8-bit layers give eager's
bits on the same inputs (`tests/test_compiled_layer.py`); what differs is what the compiler fuses around them (norms,
softmax, attention, GELU), and the plain pair shows how large that is without an 8-bit grid to amplify it.

    python tools/compile_drift.py --out outputs/bench/compile-drift.json [--preset study] [--steps 50] [--fmts plain,E4M3]
        [--data-dir DIR]
"""
import argparse, json, re, sys, tempfile, time
from pathlib import Path


def curves(preset: str, fmt, steps: int, data_dir: str, seed: int = 0) -> dict[str, list[float]]:
    "Training losses of an eager and a compiled trainer of `fmt` (None: plain), the same seed and batches, one after the other."
    import torch
    from altgrad.config import load_config
    from altgrad.trainer import Trainer
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        t = {k: Trainer(load_config(preset, data_dir=data_dir, out_dir=f"{d}/{k}", fmt=fmt, shadow=False, seed=seed,
                                    max_steps=steps, wandb_mode="disabled", compile=k == "compiled"), progress=False)
             for k in ("eager", "compiled")}
        return {k: [tr.train_step()["train/loss"] for _ in range(steps)] for k, tr in t.items()}


def drift(c: dict[str, list[float]]) -> dict:
    "First differing step (1-based; None if none), max and final |compiled - eager| of one format's curves."
    d = [abs(a - b) for a, b in zip(c["compiled"], c["eager"])]
    first = next((i + 1 for i, x in enumerate(d) if x != 0), None)
    return dict(first_differing_step=first, max_abs_diff=max(d), final_abs_diff=d[-1],
                final_loss={k: v[-1] for k, v in c.items()})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True); p.add_argument("--preset", default="study")
    p.add_argument("--steps", type=int, default=50); p.add_argument("--fmts", default="plain,E4M3")
    p.add_argument("--data-dir", default=None)
    a = p.parse_args(argv)
    if a.steps < 1: p.error(f"--steps must be >= 1, got {a.steps}")
    from altgrad.bench import _bench_data
    data = a.data_dir or _bench_data(tempfile.mkdtemp())
    res, t0 = {}, time.time()
    for f in a.fmts.split(","):
        c = curves(a.preset, None if f == "plain" else f, a.steps, data)
        res[f] = dict(drift(c), loss={k: [round(x, 6) for x in v] for k, v in c.items()})
        print(f, {k: v for k, v in res[f].items() if k != "loss"}, file=sys.stderr, flush=True)
    import torch
    import os, subprocess
    code = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                          text=True).stdout.strip()
    out = dict(made_by=f"python tools/compile_drift.py --preset {a.preset} --steps {a.steps} --fmts {a.fmts}"
                       + (f" --data-dir {a.data_dir}" if a.data_dir else " (data: 200 EurLex documents, altgrad.bench)"),
               code=code, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_average=os.getloadavg(),
               torch=torch.__version__, threads=1, seconds=round(time.time() - t0, 1), drift=res)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(out, indent=1)        # each loss curve on one line
    text = re.sub(r"\[\s+([-0-9.,\se]+?)\s+\]", lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
    Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
