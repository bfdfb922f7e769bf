"""The post-step statistics (`grid.update_stats`: the fused kernel's r with +inf where u == 0 and the median by
selection over all elements, `_moved_median`; cached constants) give the same bits as the implementation they
replaced, kept here as the reference (session 8: `masked_select` of the moved elements, then `lower_median`): every
format, saturating or not, adversarial inputs (NaN and ±inf in w and u, -0, subnormals, ties of r, no element moved,
one moved, odd and even counts), with and without flip-back, residual and view stall, eager and compiled. A NaN sum
is compared as NaN (its sign is not determined: `_bits`)."""
import math
import pytest
import torch
from altgrad.formats import FORMAT_REGISTRY, compile_kernel, get_format, quantize, _kernel_nearest, _tensor_params, \
    _want_compiled
from altgrad.grid import update_stats, land, lower_median, _scale_t, _ulp_toward
from altgrad.quantized import saturating


def _old_kernel(wb, u, wa, s, prev, res, view_stall: bool, one, small, **p):
    "`grid._stats_kernel` as it was (r returned as computed)."
    lo, m, mx = p["lo"], p["m"], p["mx"]
    r = u.abs() / _ulp_toward(_kernel_nearest(wb * s, one, **p).abs(), wb, u, s, lo, m, mx)
    moved, dw = u != 0, wa - wb
    same = (_kernel_nearest(wb + u, s, **p) == _kernel_nearest(wb, s, **p)) if view_stall else (dw == 0)
    aa = _kernel_nearest(wa * s, one, **p).abs()
    z = torch.zeros((), dtype=torch.float64, device=u.device)
    if prev is not None:
        base = wb != prev
        flip, nbase = (base & (wa == prev)).sum().double(), base.sum().double()
    else: flip, nbase = z, z
    rs = (res / _ulp_toward(aa, wa, res, s, lo, m, mx)).double().square().sum() if res is not None else z
    return r, torch.stack([moved.sum().double(), (moved & same).sum().double(), (moved & (r < 0.5)).sum().double(),
                           (dw * u).sum(dtype=torch.float64), (u * u).sum(dtype=torch.float64), z, flip, nbase,
                           (aa < small).sum().double(), z + u.numel(), rs])


_old_compiled = []

def _old_update_stats(w_before, u, w_after, fmt, scale=1.0, w_prev2=None, residual=None, view_stall=False):
    "`grid.update_stats` as it was: constants built per call, `masked_select` of the moved r, `lower_median`."
    fmt = get_format(fmt)
    wb, wa, u = w_before.detach().float(), w_after.detach().float(), u.detach().float()
    s, dev = _scale_t(scale, wb), wb.device
    small = fmt.min_normal if fmt.exp_bits else float(fmt.ulp(torch.tensor(0.0)))
    args = (wb, u, wa, s, None if w_prev2 is None else w_prev2.detach().float(),
            None if residual is None else residual.detach().float(), bool(view_stall),
            torch.ones((), device=dev), torch.tensor(small, device=dev))
    kern = _old_kernel
    if _want_compiled(wb, None):
        if not _old_compiled: _old_compiled.append(compile_kernel(_old_kernel))
        kern = _old_compiled[0]
    r, v = kern(*args, **_tensor_params(fmt, dev))
    rm = torch.masked_select(r, u != 0)
    if rm.numel(): v[5] = lower_median(rm).double()
    return v


def _bits(v: torch.Tensor) -> list:
    """The float64 sums' raw bits (-0 compared too), a NaN as "nan": the sign of a NaN sum is the sign of whichever
    NaN the product `dw * u` propagates, which the C++ compiler may commute (both kernels give NaN there)."""
    return ["nan" if math.isnan(x) else b for x, b in zip(v.tolist(), v.contiguous().view(torch.int64).tolist())]


def _inputs(fmt, n, g, case):
    "`(wb, u, wa, prev, residual)` of one adversarial case on `fmt`'s grid at scale `s`."
    s = torch.tensor(fmt.max_value / 8.0)
    wb = quantize(torch.randn(n, generator=g) * 4, fmt, s)
    u = torch.randn(n, generator=g) * 10 ** (torch.rand(n, generator=g) * 6 - 6)
    u[::5] = 0; u[1::11] = -0.0
    if case == "ties":                        # r takes few values: many equal elements at the median
        u = torch.where(u != 0, (u.sign() * fmt.ulp(wb.abs() * s) / s * torch.randint(1, 4, (n,), generator=g)), u)
    if case == "special":
        wb[2::17] = 0; wb[3::19] = -0.0; wb[4::23] = torch.finfo(torch.float32).tiny / 4      # zeros, subnormals
        wb[5::29] = math.inf; wb[6::31] = -math.inf; wb[7::37] = math.nan
        u[8::41] = math.inf; u[9::43] = math.nan; u[10::47] = 1e-44                            # r: inf, NaN, tiny
    if case == "none_moved": u = torch.zeros(n)
    if case == "one_moved": u = torch.zeros(n); u[n // 3] = 1e-3
    if case == "nan_unmoved": u[::5] = 0; wb[::5] = math.nan          # NaN r only where u == 0: not selected
    wa, c = land(wb, u, fmt, s, landing="kahan")
    prev = quantize(torch.randn(n, generator=g), fmt, s); prev[::3] = wa[::3]
    return s, wb, u, wa, prev, c


CASES = ("plain", "ties", "special", "none_moved", "one_moved", "nan_unmoved")
FORMATS = [f for f0 in FORMAT_REGISTRY.values() for f in (f0, saturating(f0))]


@pytest.mark.parametrize("mode", ["always", "never"])
def test_update_stats_bits(mode, monkeypatch):
    monkeypatch.setenv("ALTGRAD_COMPILE", mode)
    g = torch.Generator().manual_seed(29)
    checked = 0
    for fmt in FORMATS:
        for n in (20_001, 20_000, 7):                 # odd and even counts; 7 is below the compile threshold
            for case in CASES:
                s, wb, u, wa, prev, c = _inputs(fmt, n, g, case)
                for kw in (dict(), dict(w_prev2=prev, residual=c), dict(view_stall=True)):
                    w_after = wb + 3 * u if kw.get("view_stall") else wa
                    new = update_stats(wb, u, w_after, fmt, s, **kw)
                    old = _old_update_stats(wb, u, w_after, fmt, s, **kw)
                    assert _bits(new) == _bits(old), (fmt.name, n, case, kw.keys(), new, old)
                    checked += 1
    assert checked == len(FORMATS) * 3 * len(CASES) * 3


def test_median_placeholders():
    "The r median of the moved elements is NaN when a moved r is NaN, and the placeholders never win a tie."
    wb = torch.zeros(4); u = torch.tensor([0.0, 1e-3, math.nan, 0.0]); fmt = get_format("E4M3")
    assert math.isnan(update_stats(wb, u, wb, fmt, 1.0)[5].item())
    u = torch.tensor([0.0, math.inf, 0.0, 0.0])
    assert update_stats(wb, u, wb, fmt, 1.0)[5].item() == math.inf
    assert update_stats(wb, torch.zeros(4), wb, fmt, 1.0)[5].item() == 0.0        # nothing moved: 0, as before
