"""Hash the model and optimizer state after a short smoke run of every registered update regime, to show a refactor moved no bit.

    PYTHONPATH=/path/to/reference python tools/bit_identity.py run --out ref.json
    PYTHONPATH=.                  python tools/bit_identity.py run --out new.json
    python tools/bit_identity.py compare ref.json new.json
    ... run --blocks [--always] --out ...: the block recipes instead (FP32 master weights and on the block grid)

Each regime trains the `smoke` preset for `--steps` steps on E4M3 and E7M0 (one thread, eager kernels unless `--compiled`),
once from the regime's flat config keys (`master_weights`, `weight_update`, `optimizer`, `residual_dtype`: how every
committed config.yaml states it) and, where the code has it, once from the regime's name (`regime=NAME`). The hash is a
sha256 over the tensors' bytes (and the other entries' repr) of `model.state_dict()`, then `optimizer.state_dict()`, in
key order. Regimes are read from the code under test (`altgrad.regimes.UPDATE_REGIMES`); `compare` reports the ones both
files hold.
"""
from __future__ import annotations
import argparse, hashlib, json, os, sys, tempfile
from pathlib import Path

FORMATS = ("E4M3", "E7M0")
FLAT_KEYS = ("master_weights", "weight_update", "optimizer", "residual_dtype", "lr_scale")


def _feed(h, obj):
    "Add `obj` (nested dicts/lists of tensors and plain values) to the hash `h`, dict keys in sorted order."
    import torch
    if torch.is_tensor(obj):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode()); h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        for k in sorted(obj, key=repr): h.update(f"K{k!r}".encode()); _feed(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for v in obj: _feed(h, v)
    else: h.update(f"V{obj!r}".encode())


def state_hashes(trainer) -> dict:
    "{'model': sha256, 'optimizer': sha256} of the trainer's model and optimizer state."
    out = {}
    for k, sd in (("model", trainer.model.state_dict()), ("optimizer", trainer.optimizer.state_dict())):
        h = hashlib.sha256(); _feed(h, sd); out[k] = h.hexdigest()
    return out


def flat_keys(regime) -> dict:
    "The regime as the flat keys of old configs."
    d = dict(master_weights=regime.master_weights, weight_update=regime.landing, optimizer=regime.optimizer,
             residual_dtype=regime.residual_dtype)
    return d if regime.lr_scale is None else {**d, "lr_scale": regime.lr_scale}


def data_dir(path: Path) -> Path:
    "A small prepared EurLex folder (made once, as the tests' `small_data`)."
    from altgrad.data import prepare_eurlex, shared_data_dir
    if not (path / "meta.json").is_file(): prepare_eurlex(path, source=shared_data_dir() / "eurlex", max_docs=300, progress=False)
    return path


def train(overrides: dict, data: Path, steps: int, out: Path | None = None, stage: str = "whole", metrics: bool = False) -> dict:
    """Train `steps` steps and hash the state. `stage` 'half' stops after steps/2 with a checkpoint in `out`;
    'rest' resumes that checkpoint (written by other code: the old checkpoints' stored config) and trains to `steps`.
    `metrics`: also return every step's logged metrics (`perf/*` timings left out), with the FP32 shadow on."""
    from altgrad.config import load_config
    from altgrad.trainer import Trainer
    with tempfile.TemporaryDirectory() as d:
        ck = dict(checkpoint_interval=10 * steps) if stage == "whole" else dict(checkpoint_interval=steps // 2)
        cfg = load_config("smoke", data_dir=str(data), out_dir=str(out or d), max_steps=steps, wandb_mode="disabled",
                          shadow=metrics, eval_interval=steps, seed=3, resume=stage == "rest", **ck, **overrides)
        t = Trainer(cfg, progress=False)
        if stage == "rest": assert t.step == steps // 2, t.step
        logged, step = [], t.train_step
        def record():
            m = step(); logged.append({k: v for k, v in m.items() if not k.startswith("perf/")}); return m
        if metrics: t.train_step = record
        t.fit(until=steps // 2 if stage == "half" else None)
        return {**state_hashes(t), **({"metrics": logged} if metrics else {})}


def run(out: Path, data: Path, steps: int, only: list | None = None, stage: str = "whole", ckpt: Path | None = None,
        metrics: bool = False) -> dict:
    "Every regime x format; `stage` 'half' / 'rest' (with `ckpt`, a folder): checkpoint at steps/2, then resume it."
    import torch
    torch.set_num_threads(1)
    try: from altgrad.regimes import UPDATE_REGIMES, get_regime
    except ImportError:                  # a tree from before the update regime had that name (a reference commit)
        from altgrad.regimes import UPDATE_RULES as UPDATE_REGIMES, get_rule as get_regime
    import altgrad.config as C
    named = stage == "whole" and "regime" in {f.name for f in __import__("dataclasses").fields(C.TrainConfig)}
    res = {}
    for name in (only or list(UPDATE_REGIMES)):
        regime = get_regime(name)
        for fmt in FORMATS:
            where = ckpt / f"{name}-{fmt}" if ckpt else None
            tag = "flat" if stage == "whole" else f"flat-{stage}"
            res[f"{name}/{fmt}/{tag}"] = train({"fmt": fmt, **flat_keys(regime)}, data, steps, where, stage, metrics)
            if named and not metrics: res[f"{name}/{fmt}/named"] = train({"fmt": fmt, "regime": name}, data, steps)
            print(name, fmt, {k: v for k, v in res[f"{name}/{fmt}/{tag}"].items() if k != "metrics"}, file=sys.stderr, flush=True)
    out.write_text(json.dumps(dict(code=os.environ.get("PYTHONPATH", ""), steps=steps, hashes=res), indent=1) + "\n")
    return res


BLOCK_RECIPES = ("mxfp8", "mxfp6", "mxfp4", "nvfp4")
BLOCK_WEIGHTS = (("fp32", "nearest"), ("format", "nearest"), ("format", "stochastic"))


def run_blocks(out: Path, data: Path, steps: int) -> dict:
    "Every block recipe with FP32 master weights and on its block grid (nearest, stochastic), every step's metrics."
    import torch
    torch.set_num_threads(1)
    res = {}
    for r in BLOCK_RECIPES:
        for mw, wu in BLOCK_WEIGHTS:
            res[f"{r}/{mw}/{wu}"] = train({"fmt": r, "master_weights": mw, "weight_update": wu}, data, steps, metrics=True)
            print(r, mw, wu, res[f"{r}/{mw}/{wu}"]["model"][:16], file=sys.stderr, flush=True)
    out.write_text(json.dumps(dict(code=os.environ.get("PYTHONPATH", ""), steps=steps, blocks=True,
                                   compile=os.environ.get("ALTGRAD_COMPILE", "auto"), hashes=res), indent=1) + "\n")
    return res


def compare(ref: Path, new: Path) -> int:
    "Every hash of `new` against the reference's hash of the same regime and format (named runs against the flat reference)."
    a, b = json.loads(ref.read_text())["hashes"], json.loads(new.read_text())["hashes"]
    bad = 0
    for k, h in b.items():
        base = a.get(k) or a.get(k.rsplit("/", 1)[0] + "/flat")      # named and resumed runs: against the whole flat run
        ok = json.dumps(base, sort_keys=True) == json.dumps(h, sort_keys=True)   # (NaN metrics compare equal as text)
        bad += not ok
        print(f"{'same' if ok else 'DIFFERENT' if base else 'no reference'}  {k}")
    print(f"{len(b) - bad}/{len(b)} identical")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run"); r.add_argument("--out", required=True); r.add_argument("--steps", type=int, default=8)
    r.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "altgrad_bit_identity_data"))
    r.add_argument("--compiled", action="store_true", help="compiled kernels (default: ALTGRAD_COMPILE=never)")
    r.add_argument("--always", action="store_true", help="compiled kernels on every tensor, small ones included "
                   "(ALTGRAD_COMPILE=always; --compiled leaves `auto`, which keeps the smoke preset's tensors eager)")
    r.add_argument("--blocks", action="store_true", help="the block recipes (mxfp8, mxfp6, mxfp4, nvfp4) with FP32 "
                   "master weights and on their block grid (nearest, stochastic), every step's metrics, instead of the regimes")
    r.add_argument("--only", nargs="*", help="these regimes only")
    r.add_argument("--metrics", action="store_true", help="also record every step's logged metrics (shadow on; flat keys only)")
    r.add_argument("--stage", choices=("whole", "half", "rest"), default="whole",
                   help="half: stop at steps/2 with a checkpoint in --ckpt; rest: resume those checkpoints to the end")
    r.add_argument("--ckpt", help="folder of the half-way checkpoints (--stage half/rest)")
    c = sub.add_parser("compare"); c.add_argument("ref"); c.add_argument("new")
    a = p.parse_args(argv)
    if a.cmd == "compare": return compare(Path(a.ref), Path(a.new))
    if a.always: os.environ["ALTGRAD_COMPILE"] = "always"
    elif not a.compiled: os.environ["ALTGRAD_COMPILE"] = "never"
    if a.stage != "whole" and not a.ckpt: p.error("--stage half/rest needs --ckpt")
    if a.blocks:
        if a.stage != "whole" or a.only or a.metrics: p.error("--blocks takes none of --stage, --only, --metrics")
        run_blocks(Path(a.out), data_dir(Path(a.data)), a.steps)
        return 0
    run(Path(a.out), data_dir(Path(a.data)), a.steps, a.only, a.stage, Path(a.ckpt) if a.ckpt else None, a.metrics)
    return 0


if __name__ == "__main__": sys.exit(main())
