"Block recipes wherever a format name is: quantize_model, the config validator, a smoke-preset training run."
import math
import pytest
import torch
from torch import nn


def test_quantize_model_swaps_in_block_layers():
    from altgrad.quantized import quantize_model, quantized_layers
    from altgrad.block_gemm import BlockLinear, block_layers
    from altgrad.model import GPT, GPTConfig
    model = GPT(GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=64))
    quantize_model(model, "NVFP4")
    layers = block_layers(model)
    assert len(layers) == 8 and not quantized_layers(model)           # every linear but the tied LM head
    assert all(m.config.recipe.name == "nvfp4" for _, m in layers) and [m.layer_id for _, m in layers] == list(range(8))
    assert type(model.lm_head) is nn.Linear
    mixed = quantize_model(GPT(GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=64)),
                           layer_formats=[["*.mlp.*", "mxfp4"], ["*", "E4M3"]])
    assert len(block_layers(mixed)) == 4 and len(quantized_layers(mixed)) == 4
    on_grid = quantize_model(nn.Sequential(nn.Linear(64, 64)), "mxfp8", master_weights="format", weight_update="kahan")
    assert [(m.master_weights, m.weight_update) for _, m in block_layers(on_grid)] == [("format", "kahan")]
    with pytest.raises(ValueError, match="master_weights='format'"):
        quantize_model(nn.Sequential(nn.Linear(64, 64)), "mxfp8", weight_update="kahan")


def test_config_accepts_recipes_and_lists_both():
    from altgrad.config import load_config, ConfigError
    assert load_config("smoke", fmt="mxfp4").fmt == "mxfp4"
    with pytest.raises(ConfigError) as e: load_config("smoke", fmt="mxfp5")
    assert "E4M3" in str(e.value) and "nvfp4" in str(e.value) and "mxfp6" in str(e.value)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_smoke_training_with_a_recipe(fmt, small_data, tmp_path):
    from altgrad.config import load_config
    from altgrad.trainer import Trainer
    from altgrad.block_gemm import block_layers
    from altgrad.microscaling import quantize_blocks
    from altgrad.runs import load_run
    cfg = load_config("smoke", fmt=fmt, max_steps=3, data_dir=str(small_data), out_dir=str(tmp_path / fmt),
                      wandb_mode="disabled", eval_interval=3, checkpoint_interval=3)
    t = Trainer(cfg, progress=False); s = t.fit()
    assert s["final_step"] == 3 and math.isfinite(s["final_train_loss"]) and math.isfinite(s["final_val_loss"])
    assert s["quantized_layers"] == 8
    run = load_run(tmp_path / fmt)
    assert len(run.keys("sqnr_db/")) == 8 * 3 and all(math.isfinite(run.last(k)) for k in run.keys("sqnr_db/"))
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0))
    for name, m in block_layers(t.model):                              # the trained layers compute the reference
        m.eval(); x_in = x if m.in_features == 64 else torch.randn(2, 32, m.in_features)
        r = m.config.recipe
        ref = quantize_blocks(x_in, r).values @ quantize_blocks(m.weight, r, weight=True).values.T + m.bias
        with torch.no_grad(): assert torch.equal(m(x_in), ref), name


def test_run_format_papermill_with_a_recipe(small_data, tmp_path):
    "The main job trains a block recipe and its write-up carries the block diagnostics."
    import papermill as pm
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    pm.execute_notebook(str(root / "nbs" / "run_format.ipynb"), str(tmp_path / "nvfp4.ipynb"), cwd=str(root),
                        kernel_name="python3", progress_bar=False,
                        parameters=dict(fmt="NVFP4", preset="smoke", steps=4, out_dir=str(tmp_path), data_dir=str(small_data),
                                        wandb_mode="disabled"))
    report = (tmp_path / "nvfp4" / "report.md").read_text()
    assert "## Block diagnostics" in report and "| W (forward, along K) |" in report
    assert "UE4M3 scale per block of 16" in report and "Verdict: " in report
    assert (tmp_path / "nvfp4" / "figures" / "block_diagnostics.png").exists()


@pytest.mark.parametrize("fmt,regime", [("nvfp4_training", None), ("nvfp4", "kahan"), ("nvfp4", "stochastic")])
def test_block_run_resumes_bit_exactly(fmt, regime, small_data, tmp_path):
    """A block run stopped and resumed ends with the same weights as one straight run: stochastic rounding of the operands
    (nvfp4_training), and weights on an NVFP4 grid (Kahan's residual, the stochastic landing's stream)."""
    from altgrad.config import load_config
    from altgrad.trainer import Trainer
    kw = dict(fmt=fmt, data_dir=str(small_data), wandb_mode="disabled", eval_interval=2, checkpoint_interval=2,
              shadow=False, max_steps=4, **({"regime": regime} if regime else {}))
    straight = Trainer(load_config("smoke", out_dir=str(tmp_path / "a"), **kw), progress=False); straight.fit()
    first = Trainer(load_config("smoke", out_dir=str(tmp_path / "b"), **kw), progress=False); first.fit(until=2)
    resumed = Trainer(load_config("smoke", out_dir=str(tmp_path / "b"), resume=True, **kw), progress=False); resumed.fit()
    assert resumed.step == 4
    for (n, p), (_, q) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        if torch.is_tensor(p): assert torch.equal(p, q), n


def _grid_regime(landing: str) -> str:
    "The registered AdamW regime that keeps the weights on the grid and lands them by `landing`."
    from altgrad.regimes import UPDATE_REGIMES
    return next(r.name for r in UPDATE_REGIMES.values() if r.master_weights == "format" and r.landing == landing
                and r.optimizer == "adamw" and r.residual_dtype == "fp32")


def _landings():
    from altgrad.grid import LANDINGS
    return list(LANDINGS)


@pytest.mark.parametrize("fmt,landing", [("nvfp4", landing) for landing in _landings()] + [("mxfp8", "stochastic")])
def test_block_weights_on_the_grid_train(fmt, landing, small_data, tmp_path):
    "Every landing trains a block recipe with its weights on the block grid: they stay on it, and the step is measured."
    from altgrad.config import load_config
    from altgrad.trainer import Trainer
    from altgrad.block_gemm import grid_block_layers
    from altgrad.microscaling import quantize_blocks
    from altgrad.grid import LANDINGS
    from altgrad.runs import load_run
    cfg = load_config("smoke", fmt=fmt, regime=_grid_regime(landing), max_steps=3, data_dir=str(small_data),
                      out_dir=str(tmp_path / "r"), wandb_mode="disabled", eval_interval=3, checkpoint_interval=3, shadow=False)
    t = Trainer(cfg, progress=False); s = t.fit()
    assert s["final_step"] == 3 and math.isfinite(s["final_train_loss"]) and math.isfinite(s["final_val_loss"])
    layers = grid_block_layers(t.model)
    assert len(layers) == 8
    for name, m in layers:
        assert int(m.updates) == 3 and m.weight_update == landing, name
        assert torch.equal(quantize_blocks(m.weight, m.config.recipe, weight=True).values, m.weight.detach()), name
    run = load_run(tmp_path / "r")
    assert len(run.keys("stall/")) == 9 and len(run.keys("rho/")) == 9           # 8 layers and the total
    for k in ("stall/total", "rho/total", "update_ratio/total", "zero_frac/total"): assert math.isfinite(run.last(k)), k
    assert 0 <= run.last("stall/total") <= 1
    assert bool(run.keys("residual_ulp/")) == LANDINGS[landing].residual


def test_block_diagnostics_on_logged_steps_only(small_data, tmp_path):
    """The block diagnostics ride the step's second host read and are computed on the steps `fit` logs only, with the
    values `block_metrics` gives at that point; the steps in between carry none of them."""
    from altgrad.config import load_config
    from altgrad.trainer import Trainer
    from altgrad.block_gemm import block_metrics
    from altgrad.runs import load_run
    kw = dict(fmt="mxfp4", data_dir=str(small_data), wandb_mode="disabled", log_interval=3, eval_interval=5,
              checkpoint_interval=100, max_steps=7)
    t = Trainer(load_config("smoke", out_dir=str(tmp_path / "a"), **kw), progress=False)
    for step in range(1, 8):
        m, ref = t.train_step(), block_metrics(t.model)
        assert len(ref) == 7 * 3 * 8 + 1                                  # 7 figures, W/A/G, 8 layers, overflow/max
        if step in (3, 5, 6, 7): assert t.logs_step(step) and {k: m[k] for k in ref} == ref, step
        else: assert not t.logs_step(step) and not set(ref) & set(m), step
    Trainer(load_config("smoke", out_dir=str(tmp_path / "b"), **kw), progress=False).fit()
    run = load_run(tmp_path / "b")
    assert [r["step"] for r in run.metrics if "train/loss" in r] == [3, 5, 6, 7]
    assert all(sum(k.startswith("sqnr_db/") for k in r) == 24 for r in run.metrics if "train/loss" in r)


def test_block_alerts_fire_when_a_condition_starts(small_data, tmp_path):
    "A block layer's breached threshold alerts once when it starts, not at every step it lasts; it fires again after it clears."
    from altgrad.config import load_config
    from altgrad.trainer import Trainer
    t = Trainer(load_config("smoke", fmt="mxfp4", out_dir=str(tmp_path), data_dir=str(small_data), wandb_mode="disabled"),
                progress=False)
    sent = []
    class Rec:
        def alert(self, kind, title, text, level="WARN", step=None): sent.append((step, kind)); return True
        def check_thresholds(self, metrics, step, cfg=None): return []
    t.tracker = Rec()
    u, o = "underflow/transformer.h.0.mlp.c_fc/g", "overflow/transformer.h.1.attn.c_proj/a"
    steps = {1: {u: 0.2, o: 0.0}, 2: {u: 0.3, o: 0.05}, 3: {"train/loss": 1.0}, 4: {u: 0.25, o: 0.0}, 5: {u: 0.0, o: 0.0},
             6: {u: 0.2, o: 0.0}}
    for step, m in steps.items(): t.check_alerts(m, step)
    assert sent == [(1, "underflow"), (2, "overflow"), (6, "underflow")], sent


def test_block_run_resumes_exactly_with_its_alert_state(small_data, tmp_path):
    """mxfp4 with weights on the grid (Kahan landing, so a residual is carried), 4 steps straight vs 2 + resume + 2:
    the same model (weights,
    residual, grid buffers), optimizer state, logged metrics and alerts. A block alert fires once when its condition
    starts (`check_alerts`), so the conditions in force are checkpointed: a resumed run does not fire them again."""
    import json
    from altgrad.config import load_config
    from altgrad.trainer import Trainer
    from altgrad.runs import load_run
    kw = dict(fmt="mxfp4", regime="kahan", data_dir=str(small_data), wandb_mode="disabled", eval_interval=2,
              checkpoint_interval=2, shadow=False, max_steps=4)
    straight = Trainer(load_config("smoke", out_dir=str(tmp_path / "a"), **kw), progress=False); straight.fit()
    first = Trainer(load_config("smoke", out_dir=str(tmp_path / "b"), **kw), progress=False); first.fit(until=2)
    resumed = Trainer(load_config("smoke", out_dir=str(tmp_path / "b"), resume=True, **kw), progress=False)
    breached = getattr(resumed, "_block_breached", set())
    resumed.fit()
    assert resumed.step == 4
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and any(k.endswith(".residual") and v.numel() for k, v in a.items())
    for k in a:
        if torch.is_tensor(a[k]): assert torch.equal(a[k], b[k]), k
    oa, ob = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert oa.keys() == ob.keys()
    for i in oa:
        for k in oa[i]: assert torch.equal(oa[i][k], ob[i][k]), (i, k)
    skip = ("perf/", "time/", "sys/")
    def logged(d):
        return [{k: v for k, v in r.items() if not k.startswith(skip) and "time" not in k and "per_sec" not in k}
                for r in load_run(d).metrics]
    assert logged(tmp_path / "a") == logged(tmp_path / "b")
    def alerts(d): return [(r["step"], r["kind"]) for r in map(json.loads, (d / "alerts.jsonl").read_text().splitlines())]
    assert alerts(tmp_path / "a") and alerts(tmp_path / "a") == alerts(tmp_path / "b")
    assert breached and breached == first._block_breached                     # mxfp4 breaches by design


def test_madam_on_a_block_grid_is_continuous_madam_landed_per_block(small_data, tmp_path):
    """Madam with weights on an NVFP4 grid (E2M1 elements: mantissa bits, so no integer-exponent form): the continuous
    form steps, each block lands by the regime's landing and the weights stay on their block grid."""
    from altgrad.config import load_config
    from altgrad.trainer import Trainer
    from altgrad.block_gemm import grid_block_layers
    from altgrad.microscaling import quantize_blocks
    cfg = load_config("smoke", fmt="nvfp4", regime="madam", max_steps=2, data_dir=str(small_data), shadow=False,
                      out_dir=str(tmp_path), wandb_mode="disabled", eval_interval=2, checkpoint_interval=2)
    t = Trainer(cfg, progress=False); w0 = {n: m.weight.detach().clone() for n, m in grid_block_layers(t.model)}
    t.fit()
    assert type(t.optimizer).__name__ == "Madam" and not t.optimizer.intended        # no integer-exponent groups
    for name, m in grid_block_layers(t.model):
        assert int(m.updates) == 2 and m.weight_update == "stochastic", name
        assert torch.equal(quantize_blocks(m.weight, m.config.recipe, weight=True).values, m.weight.detach()), name
    assert any(not torch.equal(w0[n], m.weight) for n, m in grid_block_layers(t.model))
