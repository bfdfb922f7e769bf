"GPU check of block recipes in a model: forward equals the quantize_blocks reference on CUDA, gradients finite, diagnostics."
import torch, json, os, sys
from altgrad.model import GPT, GPTConfig
from altgrad.quantized import quantize_model
from altgrad.block_gemm import block_layers, block_metrics, block_histograms
from altgrad.microscaling import quantize_blocks
out = {}
for fmt in ("mxfp8", "nvfp4", "nvfp4_training"):
    try:
        torch.manual_seed(0)
        m = quantize_model(GPT(GPTConfig(block_size=32, vocab_size=512, n_layer=2, n_head=2, n_embd=64)), fmt).cuda()
        x = torch.randint(0, 512, (4, 32), device="cuda")
        _, loss = m(x, x); loss.backward()
        met = block_metrics(m); h = block_histograms(m)
        name, l = block_layers(m)[0]; l.eval()
        a = torch.randn(8, 64, device="cuda"); r = l.config.recipe
        with torch.no_grad(): y = l(a)
        ref = quantize_blocks(a, r).values @ quantize_blocks(l.weight, r, weight=True).values.T + l.bias
        out[fmt] = dict(loss=float(loss), grads_finite=all(bool(p.grad.isfinite().all()) for p in m.parameters() if p.grad is not None),
                        fwd_equal=bool(torch.equal(y, ref)), n_metrics=len(met), sqnr_w=met.get(f"sqnr_db/{name}/w"),
                        hist_keys=sorted(h[name]))
    except Exception as e: out[fmt] = dict(error=f"{type(e).__name__}: {e}"[:400])
print(json.dumps(out, indent=1)); print(torch.cuda.get_device_name())
