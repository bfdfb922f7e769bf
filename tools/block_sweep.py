"""block_sweep.py -- a short sweep of the block recipes, FP32 master weights and weights on the grid: outputs/blocks/summary.md.

    PYTHONPATH=. OMP_NUM_THREADS=1 python tools/block_sweep.py --runs runs/block_sweep --data DATA --steps 30

Trains the high-precision reference, the tensor-wise E4M3 and E2M1 runs for comparison, and each block recipe (smoke
preset, one seed) through the `sweep.format_config` / `sweep.train` path that `run_format` uses: first with FP32 master
weights, then (block recipes only) with the weights on their grid (`master_weights=format`) under each landing of `--landings`. Writes only
the table and a small JSON of its numbers to `--out` (no runs, checkpoints or logs). Finished reference and
tensor-wise runs of the same config in `--runs` are reused; the block runs train unless `--reuse` (then finished ones
of the same config are reused too, e.g. to rewrite the table).
"""
from __future__ import annotations
import argparse, json, sys, time
from pathlib import Path

RECIPES = ("mxfp8", "mxfp6", "mxfp4", "nvfp4")
BASELINES = ("E4M3", "E2M1")
HEAD = ("run", "elements × block, scale", "weights", "final val loss", "ratio to reference", "quantized-layer cosine",
        "mean bit-stall", "lost update",
        "SQNR W / A / G (dB)", "scale clamped (max over W, A, G)", "saturated elements (W / A / G)",
        "flushed to 0 (W / A / G)", "verdict")
NOTE = """Block figures are means over the steps and the 8 linear layers (`block_metrics`): SQNR of W and A as the
forward GEMM blocks them (along K) and of G as the input-gradient GEMM blocks it (along N) -- the other three
quantizations (W along N; G and A along M for the weight gradient) are not measured; the share of blocks holding a
non-zero element whose scale sits at its format's bottom or top code, the share of elements whose scaled value exceeds
the element format's largest value (stored as that value), and of non-zero elements flushed to zero. The saturation is
the recipes' own, and the column does not rank their clipping error. Under OCP's FLOOR scale rounding a block's largest
element lands in [2^emax, 2^(emax+1)) after scaling, partly above the element format's largest value (E2M1: [4, 8)
against 6; E4M3: [256, 512) against 448): values up to just below 8 (512) are clipped to 6 (448). NVFP4's UE4M3 block
scale rounds amax/6 to nearest, so a block's largest element scales to at most 6 x (1 + 1/16) = 6.375, which rounds to 6
anyway: NVFP4's saturated elements cost nothing beyond ordinary rounding. NVFP4's clamped scales sit at UE4M3's
smallest normal, 2^-6 times the tensor scale: blocks whose largest element is below the tensor's largest / (448 × 2^6)
(the count also takes blocks whose scale rounds to that code, so it is slightly high)."""


def num(v, f=".4g"): return "—" if v is None else format(v, f)


def row(name, run, ref, weights="FP32") -> dict:
    "One table row's numbers: `report.run_summary` and, for block runs, `block_report.block_means`."
    from altgrad.report import run_summary
    from altgrad.block_report import block_means
    from altgrad.block_gemm import is_block_format, get_gemm_config
    s, r = run_summary(run, ref), (get_gemm_config(name).recipe if is_block_format(name) else None)
    layout = (f"{r.elem} ×{r.block}, {r.scale}" + (" + FP32/tensor" if r.tensor_scale else "") if r
              else f"{name}, per-tensor delayed")
    t = run.series("perf/step_time")[1]
    keep = ("final_val_loss", "ratio_to_ref", "quantized_cos", "max_overflow", "verdict", "steps", "tokens_per_sec",
            "mean_stall", "mean_lost_update", "mean_update_ratio")
    return dict(name=name, layout=layout, weights=weights, **{k: s[k] for k in keep}, block=block_means(run),
                train_s=float(t[t == t].sum()) if len(t) else None)


def table(rows, smoke: bool) -> list[str]:
    L = ["| " + " | ".join(HEAD) + " |", "|---" * len(HEAD) + "|"]
    for r in rows:
        b = r["block"]
        trip = lambda m, f: " / ".join(num(b[o].get(m), f) for o in "wag") if b else "—"
        clamp = num(max(b[o]["scale_clamp"] for o in b), ".2%") if b else "—"
        nv = r["name"].startswith("nvfp4") and r["weights"] != "FP32"     # not comparable: see the note (†)
        stall = num(r["mean_stall"], ".3f") + (" †" if nv and r["mean_stall"] is not None else "")
        L.append(f"| {r['name']} | {r['layout']} | {r['weights']} | {num(r['final_val_loss'])} | "
                 f"{num(r['ratio_to_ref'], '.3f')} | {num(r['quantized_cos'])} | {stall} | "
                 f"{num(r['mean_lost_update'], '.3f')} | {trip('sqnr_db', '.1f')} | {clamp} | {trip('overflow', '.2%')} | "
                 f"{trip('underflow', '.2%')} | {'n/a (smoke)' if smoke else r['verdict']} |")
    return L


def figure(runs_used, path, window: int = 25):
    "Training loss (moving mean over `window` steps) of every run, one panel per weight storage; validation loss marked."
    import matplotlib; matplotlib.use("Agg")
    import matplotlib.pyplot as plt, numpy as np
    panels = list(dict.fromkeys(w for _, w, _ in runs_used))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), sharey=True, squeeze=False)
    colors = dict(reference="black", E4M3="tab:gray", E2M1="tab:brown", mxfp8="tab:blue", mxfp6="tab:green",
                  mxfp4="tab:orange", nvfp4="tab:purple")
    for ax, panel in zip(axes[0], panels):
        for name, w, run in runs_used:
            if w != panel and name != "reference": continue
            x, y = run.series("train/loss"); k = np.ones(window) / window
            ax.plot(x[window - 1:], np.convolve(y, k, "valid"), color=colors.get(name), lw=1.2, label=name)
            vx, vy = run.series("val/loss"); ax.plot(vx, vy, "o", color=colors.get(name), ms=3)
        ax.set_title(panel if panel == "FP32 master" else f"weights on the grid, {panel}", fontsize=9)
        ax.set_xlabel("step"); ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"train loss ({window}-step mean); dots: val"); axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout(); fig.savefig(path, dpi=72); plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", required=True, help="where the runs train (not committed)")
    p.add_argument("--data", required=True, help="a prepared data folder")
    p.add_argument("--out", default="outputs/blocks")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--preset", default="smoke")
    p.add_argument("--reuse", action="store_true", help="reuse finished block runs of the same config too")
    p.add_argument("--landings", default="nearest,stochastic", help="landings of the weights-on-grid runs ('' for none)")
    a = p.parse_args(argv)
    from altgrad.sweep import format_config, reference_run, run_plan, train
    from altgrad.runs import load_run
    from altgrad.config import load_config
    runs, t0 = Path(a.runs), time.time()
    ref = load_run(reference_run(runs, a.preset, a.seed, a.steps, a.data, "disabled"))
    rows, landings, runs_used = [], [x for x in a.landings.split(",") if x], [("reference", "FP32 master", ref)]
    for landing in [None] + landings:
        grid = {} if landing is None else dict(master_weights="format", weight_update=landing, tag=f"grid-{landing}")
        for name in (BASELINES if landing is None else ()) + RECIPES:     # (on the grid: the block recipes only)
            cfg = format_config(name, runs, preset=a.preset, seed=a.seed, steps=a.steps, data_dir=a.data,
                                wandb_mode="disabled", checkpoint_interval=a.steps, **grid)
            if (name in BASELINES or a.reuse) and run_plan(cfg.out_dir, cfg)[0] == "reuse": print(f"reusing {cfg.out_dir}", flush=True)
            else: print(f"training {name} {landing or 'fp32'} -> {cfg.out_dir}", flush=True); train(cfg, overwrite=True)
            rows.append(row(name, load_run(cfg.out_dir), ref, "FP32" if landing is None else f"grid, {landing}"))
            runs_used.append((name, landing or "FP32 master", load_run(cfg.out_dir)))
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    ref_loss = ref.last("val/loss")
    c, smoke, first = load_config(a.preset), a.preset == "smoke", num(float(ref.series('train/loss')[1][0]))
    dims = f"{c.n_layer} layers × {c.n_embd} wide, {'block' if smoke else 'context'} {c.block_size}, batch {c.batch_size}"
    trains = (f"**The smoke preset barely trains** (the reference's validation loss only falls to {num(ref_loss)} from "
              f"{first} at the first step): these are single runs that show the machinery works end to end, not "
              "evidence about formats or landings." if smoke else
              f"The reference's validation loss falls to {num(ref_loss)} from {first} (train loss) at the first step. "
              "These are single runs at the preset's learning rate, untuned per format: a first look, not evidence "
              "that one format or landing beats another (no seeds, no confidence intervals).")
    L = ["# Block recipes: a short sweep", "",
         f"Preset `{a.preset}` ({dims}), {a.steps} steps, seed {a.seed}, device `cpu`, "
         f"one thread, one seed. {trains} Each block run's three GEMMs per linear layer read operands "
         "block-quantized along that GEMM's reduction dimension (`BlockLinear`, round to nearest). E4M3 and E2M1 are "
         "tensor-wise runs of the same element formats (per-tensor delayed scaling), for comparison.", "",
         "Weights: `FP32` is an FP32 master copy, quantized in every GEMM. `grid, <landing>` keeps the weights on "
         "their grid (`master_weights=format`): after each optimizer step `w + u` lands back on it by the landing "
         "(`grid.LANDINGS`). For a block recipe the grid is the block grid: each element on its own block's "
         "scale, the block scales recomputed from the landed weights (`block_gemm.land_block`). Mean bit-stall is "
         "the share of moved weights that landed back on the same value (each weight on its own grid: its block's for block "
         "recipes) and lost update is 1 - ρ (ρ = <Δw, u>/<u, u>, no ulp involved), both over all layers and steps; "
         "with FP32 master weights the tensor-wise rows measure the stall of the 8-bit view, and the block rows "
         "measure none (—). On the grid the forward GEMM's W is the stored weight itself, exact: its SQNR is "
         "infinite (—). NVFP4's stall on the grid is low for another reason: its FP32 tensor scale follows the "
         "tensor's largest weight, so whenever that weight moves every weight of the tensor moves with it (same codes, "
         "see `04e_block_gemm`), and such a move is not a stall even where the weight's own update was lost: † marks "
         "NVFP4's on-grid stall, not comparable with the MX and tensor-wise rows. Under OCP FLOOR scales (the MX "
         "recipes here) a block's top weight that sits at the element format's largest value cannot grow: its growth "
         "is clipped back under nearest and stochastic landing alike (`04e_block_gemm`), which adds to the MX rows' "
         "lost update on the grid. " + ("The verdict column (final validation loss within 10% of the reference's) is not "
         "given for the smoke preset: the reference barely trains, so almost any run, even a frozen one, would pass."
         if smoke else "The verdict column: final validation loss within 10% of the reference's."), "",
         NOTE.replace("\n", " ").replace("the 8 linear layers", f"the {4 * c.n_layer} linear layers"), ""]
    train_s = sum(r["train_s"] or 0 for r in rows)
    L += table(rows, smoke) + ["", f"Made by `tools/block_sweep.py{'' if smoke else ' --runs RUNS --data DATA --preset ' + a.preset} --steps {a.steps}` (this call {time.time() - t0:.0f} s, "
                            f"finished runs of the same config reused{'' if a.reuse else ' (reference and tensor-wise)'}; "
                            f"the {len(rows)} runs in the table trained for {train_s:.0f} s in all, summed step times "
                            "on a CPU shared with other jobs).", ""]
    if not smoke: L[-1:-1] = ["", "![Training loss of each run](loss.png)"]; figure(runs_used, out / "loss.png")
    (out / "summary.md").write_text("\n".join(L))
    meta = dict(preset=a.preset, steps=a.steps, seed=a.seed, landings=landings, ref_val_loss=ref_loss, rows=rows,
                seconds=round(time.time() - t0))
    (out / "summary.json").write_text(json.dumps(meta, indent=1, default=float) + "\n")
    print("\n".join(L))


if __name__ == "__main__": sys.exit(main())
