"""Each GEMM of a `BlockLinear` reads the operands a GPU's MX/NVFP4 GEMM reads: forward A and W
blocked along K, input gradient G and W along N, weight gradient G and A along M, each quantized from high precision.
The reference is built apart from altgrad's quantizer: torchao's `to_mx`/`to_dtype` and `nvfp4_quantize` (its eager
CPU emulation) for 1-D blocks, and a hand-built quantizer from given block maxima (torchao's arithmetic, checked here
against torchao on 1-D blocks) for 2-D weight tiles. Bit-exact: operands and the three GEMM outputs."""
import warnings, logging
from dataclasses import replace
import pytest
import torch

pytest.importorskip("torchao")
logging.getLogger("torchao").setLevel(logging.ERROR)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.mx_tensor import to_mx, to_dtype
    from torchao.prototype.mx_formats.config import ScaleCalculationMode as SCM
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    from torchao.prototype.mx_formats.kernels import unpack_uint4, f4_unpacked_to_f32, f32_to_f4_unpacked
from altgrad.microscaling import get_recipe
from altgrad.block_gemm import BlockGemmConfig, BlockLinear, _BlockGemmFn, hadamard_matrix
import altgrad.block_gemm as bg

TORCHAO_ELEM = {"E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2, "E2M3": "fp6_e2m3", "E3M2": "fp6_e3m2",
                "E2M1": torch.float4_e2m1fn_x2}
MX = ["mxfp8", "mxfp8_e5m2", "mxfp6", "mxfp6_e3m2", "mxfp4"]


def _along(x, axis, fn):
    "`fn` applied to `x` (2-D) with `axis` moved last, the result moved back."
    return fn(x.contiguous()) if axis in (-1, 1) else fn(x.t().contiguous()).t()


def _torchao_mx(x, r):
    s, d = to_mx(x, TORCHAO_ELEM[r.elem], 32, getattr(SCM, r.scale_rounding.upper()))
    return to_dtype(d, s, TORCHAO_ELEM[r.elem], 32, torch.float32)


def _torchao_nvfp4(x, pts):
    s, d = nvfp4_quantize(x, 16, pts)
    e = f4_unpacked_to_f32(unpack_uint4(d.view(torch.uint8).contiguous())).reshape(x.shape[0], -1, 16)
    hp = s.float() if pts is None else pts * s.float()                            # NVFP4Tensor.get_hp_scales
    return (e * hp.reshape(x.shape[0], -1, 1)).reshape(x.shape)


def _hand_nvfp4(x, amax, pts):
    "NVFP4 of `x` (rows × K) with the given block maxima `amax` (rows × K/16): torchao's arithmetic, by hand."
    x3, eps = x.reshape(x.shape[0], -1, 16), torch.finfo(torch.float8_e4m3fn).tiny
    bs = amax / 6.0
    if pts is not None: bs = bs / pts
    s = bs.clamp(min=eps, max=448.0).to(torch.float8_e4m3fn).float()
    xs = x3 * ((1.0 / s) if pts is None else (1.0 / pts) / s).unsqueeze(-1)
    e = f4_unpacked_to_f32(f32_to_f4_unpacked(xs.clamp(-6.0, 6.0)))
    return (e * (s if pts is None else pts * s).unsqueeze(-1)).reshape(x.shape)


def _hand_mxfp8(x, amax):
    "MXFP8 (E4M3, FLOOR) of `x` with the given block maxima: OCP's scale 2^(floor(log2 amax) - 8), by hand."
    e = torch.frexp(amax)[1] - 1 - 8                                              # floor(log2 amax) - emax(E4M3)
    s = torch.exp2(e.clamp(-127, 127).float()).clamp(min=2.0 ** -126)
    x3 = x.reshape(x.shape[0], -1, 32)
    q = (x3 / s.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (q * s.unsqueeze(-1)).reshape(x.shape)


def _tile_amax(x, t, b):
    "Each t×b tile's max |x|, given to each of its rows (rows × K/b)."
    a = x.abs().reshape(x.shape[0] // t, t, -1, b).amax(dim=(1, 3), keepdim=True)
    return a.expand(-1, t, -1, 1).reshape(x.shape[0], -1)


def reference(x, r, axis, weight=False):
    "The dequantized operand a hardware GEMM reads: `x` block-quantized by recipe `r` along `axis`, apart from altgrad."
    tiles = weight and r.weight_tiles
    pts = per_tensor_amax_to_scale(x.abs().amax()) if r.tensor_scale else None
    if r.scale == "UE4M3":
        if tiles: return _along(x, axis, lambda v: _hand_nvfp4(v, _tile_amax(v, 16, 16), pts))
        return _along(x, axis, lambda v: _torchao_nvfp4(v, pts))
    if tiles:
        assert r.elem == "E4M3" and r.scale_rounding == "floor"
        return _along(x, axis, lambda v: _hand_mxfp8(v, _tile_amax(v, 32, 32)))
    return _along(x, axis, lambda v: _torchao_mx(v, r))


def _data(seed=0, M=64, K=96, N=128):
    "A, W, G: Gaussian, rows and columns of A and G spread over binades (so blocks along M and along K/N differ)."
    g = torch.Generator().manual_seed(seed)
    def spread(r, c):
        return 2.0 ** (torch.randint(-3, 4, (r, 1), generator=g) + torch.randint(-3, 4, (1, c), generator=g))
    return (torch.randn(M, K, generator=g) * 3 * spread(M, K), torch.randn(N, K, generator=g) * 0.02,
            torch.randn(M, N, generator=g) * 1e-3 * spread(M, N))


def test_hand_built_quantizers_are_torchao_on_1d_blocks():
    "The hand-built quantizers (used for 2-D tiles) give torchao's values on 1-D blocks, so the tile reference is fair."
    x, w, g = _data(1)
    for v in (x, w, g, w.t().contiguous()):
        for pts in (None, per_tensor_amax_to_scale(v.abs().amax())):
            amax = v.abs().reshape(v.shape[0], -1, 16).amax(-1)
            assert torch.equal(_hand_nvfp4(v, amax, pts), _torchao_nvfp4(v, pts))
        if v.shape[1] % 32 == 0:
            amax = v.abs().reshape(v.shape[0], -1, 32).amax(-1)
            assert torch.equal(_hand_mxfp8(v, amax), _torchao_mx(v, get_recipe("mxfp8")))


CASES = ([(n, "1-D") for n in MX + ["nvfp4"]] + [("mxfp8", "rceil"), ("mxfp4", "rceil")]
         + [("nvfp4", "tiles"), ("mxfp8", "tiles"), ("nvfp4", "tiles+hadamard")])


@pytest.mark.parametrize("name,variant", CASES)
def test_each_gemm_reads_its_own_operands(name, variant, monkeypatch):
    """Forward (A, W along K), input gradient (G, W along N), weight gradient (G, A along M): each operand is the
    independent reference, bit for bit, and so are Y, dX and dW."""
    _check_gemm_operands(name, variant, monkeypatch)


@pytest.mark.parametrize("name,variant", [("mxfp8", "1-D"), ("nvfp4", "tiles")])
def test_compiled_gemm_operands(name, variant, monkeypatch):
    """The same with every operand compiled (these matrices are below the size that compiles by default): the operands
    along M and N come from the rows view (`microscaling._blocked_rows`, row-major where the moved view gave
    column-major), and Y, dX and dW still equal the reference's GEMMs of its column-major operands."""
    monkeypatch.setenv("ALTGRAD_COMPILE", "always")
    _check_gemm_operands(name, variant, monkeypatch)


def _check_gemm_operands(name, variant, monkeypatch):
    r = get_recipe(name)
    if variant == "rceil": r = replace(r, scale_rounding="rceil")
    if variant.startswith("tiles"): r = replace(r, weight_tiles=True)
    lin = BlockLinear(96, 128, bias=False, config=BlockGemmConfig(r, hadamard=variant.endswith("hadamard"), seed=3))
    seen, real = [], bg._operand
    def spy(x, recipe, axis, rounding, gen, weight=False):                # every operand a GEMM multiplies
        v = real(x, recipe, axis, rounding, gen, weight); seen.append((x, axis, weight, v)); return v
    monkeypatch.setattr(bg, "_operand", spy)
    x, w, gy = _data()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = _BlockGemmFn.apply(xr, wr, None, lin.config, lin.gen, lin.R); y.backward(gy)
    H = hadamard_matrix(16, 3) if lin.config.hadamard else torch.eye(16)            # dW's operands rotated along M
    def rot(t): return t if not lin.config.hadamard else (H @ t.reshape(-1, 16, t.shape[1])).reshape(t.shape)
    want = {"A along K": (x, -1, False), "W along K": (w, -1, True), "G along N": (gy, -1, False),
            "W along N": (w, 0, True), "G along M": (rot(gy), 0, False), "A along M": (rot(x), 0, False)}
    assert len(seen) == 6
    ops = {}
    for (role, (t, axis, weight)), (xs, ax, wt, val) in zip(want.items(), seen):
        assert torch.equal(xs, t) and ax == axis and bool(wt) == weight, role
        ref = reference(t, r, axis, weight)
        assert torch.equal(val, ref), (role, int((val != ref).sum()))   # (rceil: no block here where torchao's
        #                                                                    log2 rounds down, 04d)
        ops[role] = ref
    assert torch.equal(y.detach(), ops["A along K"] @ ops["W along K"].t())
    assert torch.equal(xr.grad, ops["G along N"] @ ops["W along N"])
    assert torch.equal(wr.grad, ops["G along M"].t() @ ops["A along M"])
    assert not (torch.equal(ops["G along M"], ops["G along N"]) and torch.equal(ops["A along M"], ops["A along K"]))


# --- stochastic rounding of G: the grid points it may land on, and no bias -------------------------------------------

def _elem_grid(elem: str) -> torch.Tensor:
    "Every finite value of the element format, sorted, from torchao's / torch's own codecs."
    if elem == "E2M1": v = f4_unpacked_to_f32(torch.arange(16, dtype=torch.uint8))
    else: v = torch.arange(256, dtype=torch.uint8).view(TORCHAO_ELEM[elem]).float()
    return v[v.isfinite()].unique()


def _bracket_rows(v, r):
    """`v` (rows × K) in 1-D blocks along K: the block scale `hp` as torchao computes it (the scale does not depend on
    how elements round), the scaled elements `xs` (saturated), and the two element-grid points around each."""
    if r.scale == "UE4M3":
        pts = per_tensor_amax_to_scale(v.abs().amax()) if r.tensor_scale else None
        s, _ = nvfp4_quantize(v, 16, pts)
        s = s.float().reshape(v.shape[0], -1, 1)
        hp, xs = (s, v.reshape(v.shape[0], -1, 16) / s) if pts is None else \
                 (pts * s, v.reshape(v.shape[0], -1, 16) * ((1.0 / pts) / s))
    else:
        sc, _ = to_mx(v, TORCHAO_ELEM[r.elem], 32, getattr(SCM, r.scale_rounding.upper()))
        hp = torch.exp2(sc.view(torch.uint8).float() - 127).reshape(v.shape[0], -1, 1)
        xs = v.reshape(v.shape[0], -1, 32) / hp
    grid = _elem_grid(r.elem)
    xs = xs.clamp(-grid.max(), grid.max())
    lo = grid[torch.searchsorted(grid, xs.contiguous(), right=True) - 1]
    hi = grid[torch.searchsorted(grid, xs.contiguous(), right=False)]
    return hp, xs, lo, hi


def _bracket(x, r, axis):
    "(value if rounded down, value if rounded up, the unrounded value, the step) of each element, in `x`'s shape."
    def cols(v):
        hp, xs, lo, hi = _bracket_rows(v, r)
        return torch.stack([(lo * hp).reshape(v.shape), (hi * hp).reshape(v.shape), (xs * hp).reshape(v.shape),
                            ((hi - lo) * hp).reshape(v.shape)])
    return cols(x.contiguous()) if axis in (-1, 1) else cols(x.t().contiguous()).transpose(1, 2)


def _bias_violations(draws, target, lo, step, delta=1e-6):
    """Elements whose mean over `draws` strays from `target` by more than Hoeffding's bound at level `delta` (Bonferroni
    over elements), in units of the element's step; the aggregate z of the mean deviation (independent elements); and
    the same z with each deviation signed by its value's sign (a pull toward zero)."""
    live = step > 0
    d = ((draws.mean(0) - target) / torch.where(live, step, 1.0))[live].double()
    n, k = draws.shape[0], int(live.sum())
    bound = (torch.log(torch.tensor(2 * k / delta)) / (2 * n)).sqrt().item()
    p = ((target - lo) / torch.where(live, step, 1.0))[live].double().clamp(0, 1)   # P(round up)
    se = (p * (1 - p) / n).sum().sqrt()
    sign = torch.sign(target)[live].double()                 # a bias toward (or away from) zero does not cancel here
    return int((d.abs() > bound).sum()), float(d.sum() / se), float((d * sign).sum() / se)   # (count, z, signed z)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "mxfp8"])
def test_stochastic_g_lands_on_a_neighbour_and_is_unbiased(name, monkeypatch):
    """With `rounding_g='stochastic'` (the NVFP4 recipe's choice) both GEMMs that read G get, per element, one of the two
    grid points around it, on the block scale torchao computes, while A and W keep nearest; over 400 draws the mean is
    the unrounded value (Hoeffding per element, z and signed z overall). Round-to-nearest and a 3% pull toward zero
    fail the checks (the test can fail)."""
    r = get_recipe(name)
    lin = BlockLinear(96, 128, bias=False, config=BlockGemmConfig(r, rounding_g="stochastic", seed=5))
    seen, real = [], bg._operand
    def spy(x, recipe, axis, rounding, gen, weight=False):
        v = real(x, recipe, axis, rounding, gen, weight); seen.append((x, axis, rounding, v)); return v
    monkeypatch.setattr(bg, "_operand", spy)
    x, w, gy = _data(2)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    _BlockGemmFn.apply(xr, wr, None, lin.config, lin.gen, lin.R).backward(gy)
    assert [s[2] for s in seen] == ["nearest", "nearest", "stochastic", "nearest", "stochastic", "nearest"]
    monkeypatch.setattr(bg, "_operand", real)
    assert torch.equal(seen[2][0], gy) and torch.equal(seen[4][0], gy) and (seen[2][1], seen[4][1]) == (-1, 0)
    for t, axis, _, val in (seen[2], seen[4]):                                    # G along N, G along M
        lo, hi, exact, step = _bracket(t, r, axis)
        ref = reference(t, r, axis)
        assert torch.equal(ref, torch.where(ref == lo, lo, hi))                  # nearest ∈ {lo, hi}: the bracket is fair
        assert bool(((val == lo) | (val == hi)).all()), int(((val != lo) & (val != hi)).sum())
        assert 0.05 < float(((val == hi) & (step > 0)).sum() / (step > 0).sum()) < 0.95   # both neighbours are used
        gen = torch.Generator().manual_seed(11)
        draws = torch.stack([real(t, r, axis, "stochastic", gen) for _ in range(400)])
        bad, z, zs = _bias_violations(draws, exact, lo, step)
        assert bad == 0 and abs(z) < 5 and abs(zs) < 5, (bad, z, zs)
        toward0 = torch.where(torch.rand(draws.shape, generator=gen) < 0.03, torch.where(exact.abs() > 0,   # 3% of the
                  torch.where(exact > 0, lo, hi), draws), draws)                # draws rounded toward zero: caught
        assert abs(_bias_violations(toward0, exact, lo, step)[2]) > 5
        near = ref.expand(400, *t.shape)
        assert _bias_violations(near, exact, lo, step)[0] > 0.1 * int((step > 0).sum())   # nearest is biased per element
