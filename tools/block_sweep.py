"""block_sweep.py -- a short sweep of the block recipes with FP32 master weights, summarised as outputs/blocks/summary.md.

    PYTHONPATH=. OMP_NUM_THREADS=1 python tools/block_sweep.py --runs /tmp/block_sweep --data DATA --steps 120

Trains the high-precision reference, the tensor-wise E4M3 and E2M1 runs for comparison, and each block recipe (smoke
preset, one seed) through the same `sweep.format_config` / `sweep.train` path as `run_format`; writes only the table
and a small JSON of its numbers (no runs, checkpoints or logs) to `--out`. Finished reference and tensor-wise runs of
the same config in `--runs` are reused; the block runs always train.
"""
from __future__ import annotations
import argparse, json, sys, time
from pathlib import Path

RECIPES = ("mxfp8", "mxfp6", "mxfp4", "nvfp4")
BASELINES = ("E4M3", "E2M1")


def num(v, f=".4g"): return "—" if v is None else format(v, f)


def row(name, run, ref):
    "One table row's numbers: `report.run_summary` and, for block runs, `block_report.block_means`."
    from altgrad.report import run_summary
    from altgrad.block_report import block_means
    from altgrad.block_gemm import is_block_format, get_gemm_config
    s = run_summary(run, ref); b = block_means(run)
    r = get_gemm_config(name).recipe if is_block_format(name) else None
    return dict(name=name, layout=(f"{r.elem} ×{r.block}, {r.scale}" + (" + FP32/tensor" if r.tensor_scale else "")
                                   if r else f"{name}, per-tensor delayed"),
                final_val_loss=s["final_val_loss"], ratio_to_ref=s["ratio_to_ref"], quantized_cos=s["quantized_cos"],
                max_overflow=s["max_overflow"], verdict=s["verdict"], steps=s["steps"],
                tokens_per_sec=s["tokens_per_sec"], block={k: v for k, v in b.items()})


def table(rows, ref_loss) -> list[str]:
    L = ["| run | elements × block, scale | final val loss | ratio to reference | quantized-layer cosine | "
         "SQNR W / A / G (dB) | scale clamped (max over W, A, G) | saturated elements (W / A / G) | "
         "flushed to 0 (W / A / G) | verdict |", "|---" * 10 + "|"]
    for r in rows:
        b = r["block"]
        trip = lambda m, f: " / ".join(num(b[o].get(m), f) for o in "wag") if b else "—"
        clamp = num(max(b[o]["scale_clamp"] for o in b), ".2%") if b else "—"
        L.append(f"| {r['name']} | {r['layout']} | {num(r['final_val_loss'])} | {num(r['ratio_to_ref'], '.3f')} | "
                 f"{num(r['quantized_cos'])} | {trip('sqnr_db', '.1f')} | {clamp} | {trip('overflow', '.2%')} | "
                 f"{trip('underflow', '.2%')} | {r['verdict']} |")
    return L


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", required=True, help="where the runs train (not committed)")
    p.add_argument("--data", required=True, help="a prepared data folder")
    p.add_argument("--out", default="outputs/blocks")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--preset", default="smoke")
    a = p.parse_args(argv)
    from altgrad.sweep import format_config, reference_run, run_plan, train
    from altgrad.runs import load_run
    runs, t0 = Path(a.runs), time.time()
    ref_dir = reference_run(runs, a.preset, a.seed, a.steps, a.data, "disabled")
    ref = load_run(ref_dir)
    rows = []
    for name in BASELINES + RECIPES:
        cfg = format_config(name, runs, preset=a.preset, seed=a.seed, steps=a.steps, data_dir=a.data, wandb_mode="disabled",
                            checkpoint_interval=a.steps)
        if name in BASELINES and run_plan(cfg.out_dir, cfg)[0] == "reuse": print(f"reusing {cfg.out_dir}", flush=True)
        else: print(f"training {name} -> {cfg.out_dir}", flush=True); train(cfg, overwrite=True)
        rows.append(row(name, load_run(cfg.out_dir), ref))
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    ref_loss = ref.last("val/loss")
    L = ["# Block recipes: a short sweep", "",
         f"Preset `{a.preset}` (2 layers × 64 wide, block 32, batch 4), {a.steps} steps, seed {a.seed}, device `cpu`, one "
         f"thread. Reference: final validation loss {num(ref_loss)} (FP32). Master weights: FP32 in every run; each "
         "block run's three GEMMs per linear layer read operands block-quantized from high precision along that GEMM's "
         "reduction dimension (`BlockLinear`, round to nearest). E4M3 and E2M1 are the tensor-wise runs of the same element "
         "formats (per-tensor delayed scaling), for comparison. Weights on a block grid are not built, so the sweep has "
         "no on-grid rows.", "",
         "Block figures are means over the steps and the 8 linear layers (`block_metrics`): SQNR of each operand, the "
         "share of blocks holding a non-zero element whose scale sits at its format's bottom or top code, the share of elements that saturate at the "
         "element format's largest value, and of non-zero elements flushed to zero.", ""]
    L += table(rows, ref_loss) + ["", f"Made by `tools/block_sweep.py` in {time.time() - t0:.0f} s.", ""]
    (out / "summary.md").write_text("\n".join(L))
    (out / "summary.json").write_text(json.dumps(dict(preset=a.preset, steps=a.steps, seed=a.seed, ref_val_loss=ref_loss,
                                                      rows=rows), indent=1, default=float) + "\n")
    print("\n".join(L))


if __name__ == "__main__": sys.exit(main())
