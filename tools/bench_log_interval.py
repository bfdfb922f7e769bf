"""What `log_interval` saves: plain and 8-bit trainers of one preset, logging every step and every N-th step, their
steps interleaved in one process (`altgrad.bench.interleave_steps`); JSON on stdout with the mean step time over whole
logging intervals (the unlogged steps and the logged one) and the ratios. Usage:
`python tools/bench_log_interval.py [--preset study] [--fmt E4M3] [--every 10] [--rounds 4] --data-dir DIR`."""
import argparse, json, statistics, sys, tempfile
from pathlib import Path
import torch
from altgrad.bench import interleave_steps, _env
from altgrad.config import load_config
from altgrad.trainer import Trainer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="study"); p.add_argument("--fmt", default="E4M3")
    p.add_argument("--every", type=int, default=10, help="log_interval of the sparse trainers")
    p.add_argument("--rounds", type=int, default=4, help="logging intervals timed (steps = rounds * every)")
    p.add_argument("--data-dir", required=True)
    a = p.parse_args(argv)
    steps, variants = a.rounds * a.every, {}
    for fmt in (None, a.fmt):
        for li in (1, a.every): variants[f"{fmt or 'plain'}@{li}"] = dict(fmt=fmt, log_interval=li)
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {k: Trainer(load_config(a.preset, data_dir=a.data_dir, out_dir=str(Path(tmp) / k.replace("@", "_")),
                                           max_steps=10 * steps, shadow=False, wandb_mode="disabled", **v), progress=False)
                    for k, v in variants.items()}
        # warm-up: one whole logging interval, so that each trainer's timed steps start at a logged step's successor
        times = interleave_steps(trainers, steps, warmup=a.every)
        device = next(iter(trainers.values())).device
    mean = {k: statistics.mean(v) for k, v in times.items()}
    plain, q = f"plain@{a.every}", f"{a.fmt}@{a.every}"
    res = dict(tool="tools/bench_log_interval.py", preset=a.preset, fmt=a.fmt, every=a.every, timed_steps=steps,
               **_env(device), mean_step_time=mean,
               ratio_to_plain_every_step={k: v / mean["plain@1"] for k, v in mean.items()},
               ratio_8bit_to_plain={"every step": mean[f"{a.fmt}@1"] / mean["plain@1"],
                                    f"every {a.every} steps": mean[q] / mean[plain]},
               saved_by_log_interval={"plain": 1 - mean[plain] / mean["plain@1"],
                                      a.fmt: 1 - mean[q] / mean[f"{a.fmt}@1"]})
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__": sys.exit(main())
