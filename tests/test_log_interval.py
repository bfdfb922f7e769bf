"""The fast step: with `log_interval` > 1 the trainer computes a step's statistics only on the steps it logs
(`Trainer.measures_step`), and trains exactly as when it measures every step: the same model and optimizer state, and
on every logged step the same metrics, bit for bit, for every registered regime (and a skipped step between two logged
ones, which is logged with its gradient statistics)."""
import math
import pytest
import torch


def _eq(a, b) -> bool:
    "Nested equality of state dicts: tensors bit for bit (`torch.equal`), containers by structure."
    if torch.is_tensor(a): return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict): return isinstance(b, dict) and a.keys() == b.keys() and all(_eq(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)): return len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))
    return a == b


def _poison(step: int, model):
    "A fault: step 2's first gradient holds a NaN (the step is skipped)."
    if step == 2: next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = math.nan


def _trainer(data, out, log_interval: int, fmt: str, regime: str, fault=None, steps: int = 7, shadow: bool = True,
             **kw):
    from altgrad.config import load_config
    from altgrad.trainer import Trainer
    cfg = load_config("smoke", data_dir=str(data), out_dir=str(out), max_steps=steps, eval_interval=100,
                      wandb_mode="disabled", fmt=fmt, regime=regime, log_interval=log_interval, shadow=shadow, **kw)
    return Trainer(cfg, progress=False, fault=fault)


def _fit(data, out, log_interval: int, fmt: str, regime: str, fault=None):
    "`fit` a smoke run; the trainer and its logged records by step (as written to disk)."
    from altgrad.tracking import read_metrics
    t = _trainer(data, out, log_interval, fmt, regime, fault)
    t.fit()
    return t, {r["step"]: r for r in read_metrics(t.run_dir, merge=True)}


def _steps(data, out, log_interval: int, fmt: str, regime: str, steps: int = 4, shadow: bool = False, **kw):
    "`train_step` alone (no files): the trainer and the metrics of the steps `fit` would log."
    t, logged = _trainer(data, out, log_interval, fmt, regime, steps=steps, shadow=shadow, **kw), {}
    for _ in range(steps):
        m = t.train_step()
        if t.logs_step(t.step, bool(m["train/skipped"])): logged[t.step] = m
    return t, logged


def _same_run(a, b, la: dict, lb: dict, label: str) -> int:
    "Asserts that run b (log_interval > 1) trained as run a (every step) and logged the same values; returns #values."
    assert _eq(a.model.state_dict(), b.model.state_dict()), f"{label}: the model moved"
    assert _eq(a.optimizer.state_dict(), b.optimizer.state_dict()), f"{label}: the optimizer state moved"
    assert _eq(a.dead.streak, b.dead.streak) and a.dead.seen == b.dead.seen, f"{label}: the dead-neuron streaks moved"
    assert set(lb) < set(la) and max(lb) == max(la), (label, sorted(lb))
    n = 0
    for step, mb in lb.items():
        ma = {k: v for k, v in la[step].items() if not k.startswith("perf/") and k not in ("_timestamp", "_runtime")}
        mb = {k: v for k, v in mb.items() if not k.startswith("perf/") and k not in ("_timestamp", "_runtime")}
        assert ma.keys() == mb.keys(), f"{label} step {step}: {set(ma) ^ set(mb)}"
        bad = [k for k in ma if repr(ma[k]) != repr(mb[k])]               # repr: bit for bit, NaN equal to NaN
        assert not bad, f"{label} step {step}: {[(k, ma[k], mb[k]) for k in bad[:5]]}"
        n += len(mb)
    return n


def test_unmeasured_steps_train_the_same(tmp_path, small_data, fmt="E7M0"):
    "Every registered regime on E7M0 (every weight update lands on a power of two), 4 steps logged at 3 and 4."
    from altgrad.regimes import UPDATE_REGIMES
    n = 0
    for regime in UPDATE_REGIMES:
        a, la = _steps(small_data, tmp_path / f"{regime}-1", 1, fmt, regime)
        b, lb = _steps(small_data, tmp_path / f"{regime}-3", 3, fmt, regime)
        assert sorted(lb) == [3, 4], sorted(lb)
        n += _same_run(a, b, la, lb, f"{fmt}/{regime}")
    assert n > 1000, n


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_block_grids_and_the_shadow_train_the_same(tmp_path, small_data, fmt):
    "Weights on a block grid (`_land_block`) under three landings, with the FP32 shadow's cosines on the logged steps."
    n = 0
    for regime in ("nearest", "stochastic", "kahan"):
        a, la = _steps(small_data, tmp_path / f"{regime}-1", 1, fmt, regime, shadow=True)
        b, lb = _steps(small_data, tmp_path / f"{regime}-3", 3, fmt, regime, shadow=True)
        assert any(k.startswith("grad_cos_sim/") for k in lb[3]), sorted(lb[3])[:10]
        n += _same_run(a, b, la, lb, f"{fmt}/{regime}")
    assert n > 300, n


def test_dead_neuron_streaks_see_every_step(tmp_path, small_data):
    "A window of 2 steps and a threshold every row is under: dead fractions are 1 from step 2 on, logged or not."
    kw = dict(dead_neuron_window=2, dead_neuron_threshold=1e30)
    a, la = _steps(small_data, tmp_path / "every", 1, "E4M3", "nearest", **kw)
    b, lb = _steps(small_data, tmp_path / "third", 3, "E4M3", "nearest", **kw)
    dead = {k: v for k, v in lb[3].items() if k.startswith("dead_neuron_frac/")}
    assert dead and all(v == 1.0 for v in dead.values()), dead
    _same_run(a, b, la, lb, "dead neurons")


def test_a_skipped_unmeasured_step_is_logged_in_full(tmp_path, small_data):
    a, la = _fit(small_data, tmp_path / "every", 1, "E4M3", "stochastic", fault=_poison)
    b, lb = _fit(small_data, tmp_path / "third", 3, "E4M3", "stochastic", fault=_poison)
    assert sorted(lb) == [2, 3, 6, 7] and lb[2]["train/skipped"] == 1.0, sorted(lb)      # 2: skipped, so logged
    assert any(k.startswith("grad_norm_l2/") for k in lb[2]) and any(k.startswith("dead_neuron_frac/") for k in lb[2])
    _same_run(a, b, la, lb, "skipped step")


def test_unmeasured_steps_skip_the_statistics(tmp_path, small_data):
    "The point of it: on a step that is not logged, no update statistics are computed (`grid.update_stats` not called)."
    import altgrad.step as step_mod
    calls = []
    orig = step_mod.update_stats
    step_mod.update_stats = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try: b, lb = _steps(small_data, tmp_path / "third", 3, "E4M3", "nearest", steps=7)
    finally: step_mod.update_stats = orig
    from altgrad.quantized import quantized_layers
    assert len(calls) == 3 * len(quantized_layers(b.model)) > 0, len(calls)     # steps 3, 6 and 7 only
