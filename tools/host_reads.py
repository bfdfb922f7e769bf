"""Count the host synchronisations of one training step on CUDA, and where they come from.

    python tools/host_reads.py --data-dir DIR [--preset gpu] [--fmt E5M2] [--steps 3] [--set key=value ...]

Trains `--steps` steps (the first one warms up and is not counted) under `torch.cuda.set_sync_debug_mode("warn")`;
every synchronising CUDA call is then a warning, which is attributed to the line of altgrad (or torch) that made it.
Prints one JSON object: syncs per counted step and the count per source line. Needs CUDA."""
from __future__ import annotations
import argparse, collections, json, sys, tempfile, traceback, warnings


def count(preset: str, fmt: str | None, steps: int, data_dir: str, overrides: dict) -> dict:
    import torch
    from altgrad.config import load_config
    from altgrad.trainer import Trainer
    if not torch.cuda.is_available(): raise SystemExit("host_reads.py needs CUDA")
    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(preset, data_dir=data_dir, out_dir=d, fmt=fmt, max_steps=steps + 1, wandb_mode="disabled",
                          device="cuda", **overrides)
        t = Trainer(cfg, progress=False)
        t.train_step(); torch.cuda.synchronize()                    # warm-up: lazy buffers, compiled kernels
        where: collections.Counter = collections.Counter()
        def note(message, category, filename, lineno, file=None, line=None):
            frames = [f for f in traceback.extract_stack()[:-1] if "/altgrad/" in f.filename or "/torch/optim" in f.filename]
            f = frames[-1] if frames else traceback.extract_stack()[-3]
            where[f"{f.filename.split('/')[-1]}:{f.lineno} {(f.line or '').strip()[:80]}"] += 1
        old = warnings.showwarning
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always"); warnings.showwarning = note
                for _ in range(steps): t.train_step()
        finally:
            torch.cuda.set_sync_debug_mode("default"); warnings.showwarning = old
    n = sum(where.values())
    return dict(preset=preset, fmt=fmt, overrides=overrides, steps=steps, syncs=n, syncs_per_step=n / steps,
                device=torch.cuda.get_device_name(), sources=dict(where.most_common()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", required=True); p.add_argument("--preset", default="gpu")
    p.add_argument("--fmt", default="E5M2"); p.add_argument("--steps", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    from altgrad.config import parse_overrides
    print(json.dumps(count(a.preset, None if a.fmt.lower() == "none" else a.fmt, a.steps, a.data_dir, parse_overrides(a.set)), indent=1))
    return 0


if __name__ == "__main__": sys.exit(main())
