"""The block diagnostics (`block_gemm.operand_diagnostics`, one fused pass, compiled where the block quantizer
compiles) give the same bits as the implementation they replaced, kept here as the reference: every recipe under every
scale rounding, 1-D blocks and 2-D weight tiles, adversarial inputs (amaxes at powers of two and ties, subnormals,
zeros, ±inf, NaN, -0, an all-zero tensor, a transposed one), eager and compiled. Every figure's bytes are compared
(-0 included), except that a NaN figure need only be NaN on both sides: in the full suite, compiled nvfp4 on NaN inputs
once gave qmse a NaN of the other sign than the reference (a44492c's CI run; not reproduced alone), and a logged NaN
carries no sign."""
import pytest
import torch
from test_block_kernel import _variants, _inputs


def _reference(x, recipe, weight=False):
    "The diagnostics as computed before (session 6): `quantize_blocks`, `block_stats`, masks and block shares."
    from altgrad.microscaling import get_recipe, quantize_blocks, block_stats, _blocked, _scale_code_range
    from altgrad.formats import get_format, to_bits
    r = get_recipe(recipe); x = x.detach().float(); b = quantize_blocks(x, r, weight=weight)
    share = lambda m: _blocked(m.float().reshape(-1, m.shape[-1]), r, weight).amax(dim=(1, 3)).mean()
    s = block_stats(x, b, r)
    sat = (b.elements.abs() == get_format(r.elem).max_value) & (x.abs() > b.values.abs())
    und = (b.values == 0) & (x != 0)
    nz = _blocked(x.reshape(-1, x.shape[-1]), r, weight).abs().amax(dim=(1, 3)) > 0
    codes = (b.scales if r.scale == "UE8M0" else to_bits(b.scales, r.scale)).long()
    lo, hi = _scale_code_range(r)
    hit = codes <= lo if r.tensor_scale else (codes <= lo) | (codes >= hi)
    d = {"scale_clamp": (hit & nz).float().sum() / nz.sum().clamp(min=1),
         "overflow": s["saturated"], "underflow": s["underflow"],
         "block_overflow": share(sat), "block_underflow": share(und),
         "qmse": s["mse"], "sqnr_db": s["sqnr_db"]}
    return d, s["scale_hist"]


def _cases(r):
    x = _inputs(r)
    yield "adversarial", x
    yield "finite", torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    yield "transposed", torch.nan_to_num(_inputs(r)[:64].t().contiguous().t()[:, :64].t(), nan=1.0)
    yield "zeros", torch.zeros(64, 64)
    yield "small", torch.randn(32, 64, generator=torch.Generator().manual_seed(1)) * 2.0 ** -120


def _bits(t: torch.Tensor) -> tuple:
    "(dtype, the raw bytes) of a scalar: NaN payloads and -0 compared too."
    return t.dtype, t.reshape(1).contiguous().view(torch.uint8).tolist()


@pytest.mark.parametrize("compiled", ["never", "always"])
@pytest.mark.parametrize("name,r", list(_variants()), ids=lambda v: v if isinstance(v, str) else "")
def test_diagnostics_bits(name, r, compiled, monkeypatch):
    from altgrad.block_gemm import operand_diagnostics
    monkeypatch.setenv("ALTGRAD_COMPILE", compiled)
    for case, x in _cases(r):
        for weight in (False, True):
            want, want_h = _reference(x, r, weight)
            got, got_h = operand_diagnostics(x, r, weight)
            assert list(got) == list(want)
            for k in want:
                nan = bool(torch.isnan(got[k])) and bool(torch.isnan(want[k]))   # (NaN's sign: see the docstring)
                assert nan or _bits(got[k]) == _bits(want[k]), (name, case, weight, k, got[k], want[k])
            assert torch.equal(got_h, want_h), (name, case, weight, "scale_hist")
