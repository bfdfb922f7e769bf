"""A new landing and a new optimizer, registered from outside the package.

Each is one registration here and nothing in `altgrad` names it: a biased rounding that carries a residual
(`shrink`: w + u + residual shrunk by 1/16 toward zero, then rounded to nearest) and SGD with momentum. Each trains a
few steps through the real `Trainer` with the weights on the E4M3 grid; then the run's write-up, the regime matrix and
the study describe them from their registry entries.
"""
import json
import pytest
import torch

from altgrad.config import load_config
from altgrad.formats import quantize
from altgrad.grid import LANDINGS, Landing, register_landing
from altgrad.optim import OPTIMIZERS, OptimizerSpec, decay_groups, register_optimizer
from altgrad.quantized import quantized_layers
from altgrad.regimes import UPDATE_REGIMES, UpdateRegime, register_regime, regime_name
from altgrad.trainer import Trainer


def _shrink(w, u, fmt, scale, residual, generator):
    "Biased rounding: (w + u + residual) shrunk by 1/16 toward zero, rounded to nearest; the residual keeps what was lost."
    y = u if residual is None else u + residual.float()
    w_new = quantize((w + y) * (1 - 2.0 ** -4), fmt, scale)
    return w_new, y - (w_new - w)


def _sgdm(params, lr, weight_decay, betas, device_type, grid, **kw):
    return torch.optim.SGD(decay_groups(params, weight_decay), lr=lr, momentum=0.9)


@pytest.fixture
def extensions():
    "Register the landing, the optimizer and a regime for each; remove them afterwards."
    register_landing(Landing("shrink", _shrink, residual=True))
    register_optimizer(OptimizerSpec("sgdm", _sgdm, lr_scale=30.0))
    regimes = (register_regime(UpdateRegime("shrink", "biased shrink rounding with residual", "format", "shrink", "adamw")),
             register_regime(UpdateRegime("sgdm", "SGD with momentum (stochastic landing)", "format", "stochastic", "sgdm")))
    yield regimes
    for r in regimes: del UPDATE_REGIMES[r.name]
    del LANDINGS["shrink"], OPTIMIZERS["sgdm"]


def _train(regime, out, data):
    cfg = load_config("smoke", regime=regime.name, fmt="E4M3", data_dir=str(data), out_dir=str(out), max_steps=4,
                      eval_interval=4, checkpoint_interval=4, wandb_mode="disabled", shadow=False)
    t = Trainer(cfg, progress=False)
    w0 = {n: m.weight.detach().clone() for n, m in quantized_layers(t.model)}
    t.fit()
    for n, m in quantized_layers(t.model):                                # on the grid, and moved
        w = m.weight.detach()
        assert torch.equal(quantize(w * m.grid_scale, m.fmt) / m.grid_scale, w), n
    assert sum(int((m.weight.detach() != w0[n]).sum()) for n, m in quantized_layers(t.model)) > 0
    return t


def test_new_landing_and_optimizer(tmp_path, small_data, extensions, monkeypatch):
    monkeypatch.setenv("ALTGRAD_COMPILE", "never")
    shrink, sgdm = extensions
    runs = {r.name: _train(r, tmp_path / "runs" / r.name, small_data) for r in extensions}
    assert isinstance(runs["sgdm"].optimizer, torch.optim.SGD)
    assert all(m.residual.shape == m.weight.shape for _, m in quantized_layers(runs["shrink"].model))   # it carries its residual
    for name in runs:                                                     # the saved config reads back as the regime
        back = load_config(tmp_path / "runs" / name / "config.yaml")
        assert back.regime == UPDATE_REGIMES[name] and regime_name(back) == name

    # the write-up of each run
    from altgrad.report import write_report
    text = {}
    for name in runs:
        text[name] = write_report(tmp_path / "runs" / name, None, tmp_path / "reports" / name).read_text()
    assert "`weight_update=shrink`" in text["shrink"] and "per-weight residual" in text["shrink"]
    assert "The shrink residual costs `residual_dtype=fp32`: 4 bytes per parameter" in text["shrink"]
    assert "`optimizer=sgdm`" in text["sgdm"] and "learning-rate scale 30 (sgdm's default" in text["sgdm"]
    assert "per-weight residual" not in text["sgdm"] and "updates the grid cannot hold are lost" in text["sgdm"]

    # the regime matrix: one weights-on-grid sweep folder per regime
    from altgrad.sweep_summary import summary_rows
    from altgrad.runs import load_run
    from altgrad.matrix import matrix_markdown, regime_matrix
    for name in runs:
        d = tmp_path / "matrix" / name; d.mkdir(parents=True)
        rows = summary_rows({"E4M3": load_run(tmp_path / "runs" / name)})
        (d / "summary.json").write_text(json.dumps([{**r, **runs[name].cfg.to_dict()} for r in rows], default=str))
    m = regime_matrix(tmp_path / "matrix")
    assert m["regimes"] == ["sgdm", "shrink"] and m["formats"] == ["E4M3"]
    assert all(m["metrics"]["final_val_loss"]["E4M3"][r] is not None for r in m["regimes"])
    assert "sgdm" in matrix_markdown(m) and "shrink" in matrix_markdown(m)
    from altgrad.sweep_cli import matrix_note
    assert "sgdm 0.03" in matrix_note("smoke", 4, 42, {}, ["E4M3"])           # its default rate, from its registry entry

    # the study: the regimes are valid choices, at their optimizer's rate, labelled and compared by capability
    from altgrad.study import lr_scale_for, normalize_regimes
    from altgrad.answer import decisive_protocol_section
    assert normalize_regimes(["stochastic", "shrink", "sgdm"]) == ["fp32", "nearest", "stochastic", "shrink", "sgdm"]
    assert (lr_scale_for("sgdm", 1.0), lr_scale_for("shrink", 3.0)) == (30.0, 3.0)
    # what the study's answer.md prints for them: each regime by name and registry label in its protocol
    plan = dict(preset="smoke", steps=4, formats=["E4M3"], regimes=["fp32", "nearest", "shrink", "sgdm"])
    proto = dict(tuning_seeds=[1], heldout_seeds=[2], base_mults=[1.0], extend_factor=3, max_extensions=0,
                 choice_rule="min")
    st = dict(plan=plan, protocol=proto, budget=dict(runs=8, total_seconds=60.0), devices=["cpu"])
    protocol = "\n".join(decisive_protocol_section(st, {}))
    assert ("**regimes** `fp32` (FP32 master weights), `nearest` (round-to-nearest), `shrink` (biased shrink rounding "
            "with residual), `sgdm` (SGD with momentum (stochastic landing))") in protocol, protocol
