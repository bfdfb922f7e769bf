"""The traced 8-bit layer (`traced.enable_traced`, `compile=on`) against the eager one: bit identity on the same inputs.

Per format: a three-layer stack (nearest/delayed/max, stochastic/delayed/most_recent, stochastic/current) compiled as a
whole, eager and compiled fed the same inputs and output gradients. Per update regime: two smoke trainers, one with
its 8-bit layers compiled one by one (so that nothing else in the model is compiled and every input to a layer is the
same), three steps: every logged metric, every parameter (landed weights) and buffer (residuals, grid scales, amax
histories, scales) equal bit for bit. And a whole-model compiled run records which path each layer took."""
import copy, json, math
import pytest
import torch
import torch.nn as nn
from altgrad.formats import FORMAT_REGISTRY, KERNEL_OPTIONS
from altgrad.regimes import UPDATE_REGIMES
from altgrad.traced import enable_traced, prepare_traced, book_traced
from altgrad.quantized import (QuantizedLinear, quantized_layers,
                               set_accumulation, commit_amax)

torch._dynamo.config.cache_size_limit = 64


def _stack(fmt):
    torch.manual_seed(0)
    kw = dict(fmt=fmt, fmt_backward="E5M2" if fmt != "E5M2" else "E4M3", amax_history_len=4)
    return nn.Sequential(QuantizedLinear(16, 32, rounding="nearest", **kw),
                         QuantizedLinear(32, 24, rounding="stochastic", amax_algo="most_recent", **kw),
                         QuantizedLinear(24, 8, rounding="stochastic", scaling="current", **kw))


def _same_layers(ref, net):
    for (n, a), (_, b) in zip(quantized_layers(ref), quantized_layers(net)):
        for r, qa in a.quantizers().items():
            qb = b.quantizers()[r]
            for k in ("last", "scale", "counts"):
                assert torch.equal(getattr(qa, k), getattr(qb, k)), f"{n}.{r}.{k}"
            if qa.history is not None: assert torch.equal(qa.history.history, qb.history.history), f"{n}.{r} history"
            assert (qa.total, qa._sr_n, int(qa.sr_count)) == (qb.total, qb._sr_n, int(qb.sr_count)), f"{n}.{r} counters"
        for (k, p), q in zip(a.named_parameters(), b.parameters()):
            assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), f"{n}.{k} grad"


# every 8-bit format, and the 4-, 6- and 16-bit element formats as tensor-wise layers
FORMATS = list(FORMAT_REGISTRY) + ["E2M1", "E2M3", "E3M2", "FP16", "BF16"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_bit_identical(fmt):
    _twins(fmt)


def test_bf16_autocast_bit_identical():
    "Under CPU bf16 autocast: the traced layer quantizes with autocast off, as eager does, and returns bf16."
    _twins("E4M3", autocast=torch.bfloat16)


def _twins(fmt, autocast=None):
    ref = _stack(fmt); net = copy.deepcopy(ref)
    assert set(enable_traced(net).values()) == {"traced"}
    set_accumulation(ref, True); set_accumulation(net, True)
    cnet = torch.compile(net, options=KERNEL_OPTIONS)
    for step in range(3):
        for k in range(2):                                        # two micro-batches: pending amaxes
            g = torch.Generator().manual_seed(10 * step + k)
            x, c = torch.randn(3, 7, 16, generator=g) * 4.0 ** step, torch.randn(3, 7, 8, generator=g)
            dx = []
            for model, f, traced in ((ref, ref, False), (net, cnet, True)):
                xx = x.clone().requires_grad_()
                if traced: prepare_traced(model, x[..., 0])
                with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                    y = f(xx)
                assert y.dtype == (autocast or torch.float32)
                (y.float() * c).sum().backward()
                if traced: book_traced(model)
                dx.append(xx.grad)
            assert torch.equal(*dx)
        commit_amax(ref); commit_amax(net)
        _same_layers(ref, net)
        for m in (ref, net): m.zero_grad()


def _trainer(tmp, regime, small_data, traced):
    from altgrad.config import load_config
    from altgrad.trainer import Trainer
    cfg = load_config("smoke", fmt="E4M3", regime=regime, max_steps=3, data_dir=str(small_data),
                      out_dir=str(tmp / f"{regime}-{traced}"), wandb_mode="disabled", log_interval=1)
    t = Trainer(cfg, progress=False)
    if traced:
        assert set(enable_traced(t.model).values()) == {"traced"}
        for _, m in quantized_layers(t.model): m.compile(options=KERNEL_OPTIONS)   # the layers only
        t.traced = True
    return t


@pytest.mark.parametrize("regime", list(UPDATE_REGIMES))
def test_every_regime_bit_identical(regime, small_data, tmp_path):
    a, b = _trainer(tmp_path, regime, small_data, False), _trainer(tmp_path, regime, small_data, True)
    for step in range(3):
        ma, mb = a.train_step(), b.train_step()
        ka = {k: v for k, v in ma.items() if not k.startswith("perf/")}
        kb = {k: v for k, v in mb.items() if not k.startswith("perf/")}
        assert ka.keys() == kb.keys()
        for k in ka: assert ka[k] == kb[k] or (ka[k] != ka[k] and kb[k] != kb[k]), f"step {step + 1}: {k}"
        sa, sb = a.model.state_dict(), b.model.state_dict()
        for k in sa:
            if torch.is_tensor(sa[k]): assert torch.equal(sa[k], sb[k]), f"step {step + 1}: {k}"
        _same_layers(a.model, b.model)


def test_compiled_run_records_layer_paths(small_data, tmp_path):
    from altgrad.config import load_config
    from altgrad.trainer import Trainer
    cfg = load_config("smoke", fmt="E4M3", max_steps=2, data_dir=str(small_data), out_dir=str(tmp_path / "c"),
                      wandb_mode="disabled", compile=True, eval_interval=2, checkpoint_interval=2)
    torch._dynamo.utils.counters.clear()
    t = Trainer(cfg, progress=False)
    for _ in range(2): t.train_step()
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}     # the training step: one graph, no break
    s = t.fit()                                           # (evaluation: the layers run eager, a break each)
    assert s["compiled"] and set(s["layer_paths"].values()) == {"traced"} and len(s["layer_paths"]) == 8
    assert s["compile_options"] == KERNEL_OPTIONS and json.loads((t.run_dir / "summary.json").read_text())[
        "compile_options"] == KERNEL_OPTIONS
    assert math.isfinite(s["final_train_loss"])
    off = Trainer(load_config("smoke", fmt="E4M3", max_steps=1, data_dir=str(small_data), out_dir=str(tmp_path / "e"),
                              wandb_mode="disabled", interventions=True, compile=True), progress=False)
    assert set(off.layer_paths.values()) == {"eager"} and not off.traced
    assert off.fit()["compile_options"] == {}             # no traced layer: the graph compiled with Inductor's defaults
