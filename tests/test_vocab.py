"""The compact output vocabulary end to end: `altgrad-prepare --vocab K`, the unigram baseline on it, a trainer that
runs on it, and the 8-bit share of the model it trains (`GPT.compute_split`). Small data, made in the test."""
import json, math, os, subprocess, sys
from pathlib import Path

import numpy as np
import pytest
import torch

from altgrad.data import TokenData, load_vocab, prepare_eurlex, prepare_vocab, shared_data_dir, unigram_baseline, vocab_info

K = 256


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    "A small full-vocabulary EurLex folder and its top-K folder beside it."
    base = tmp_path_factory.mktemp("vocab") / "eurlex"
    prepare_eurlex(base, source=shared_data_dir() / "eurlex", max_docs=60, progress=False)
    prepare_vocab(base, K)
    return base, base.with_name(f"eurlex-top{K}")


def test_cli_writes_its_own_folder(tmp_path, data):
    base, _ = data
    out = tmp_path / "top128"
    r = subprocess.run([sys.executable, "-c", "import sys; from altgrad.data import prepare_cli; sys.exit(prepare_cli())",
                        "--source", str(shared_data_dir() / "eurlex"), "--max-docs", "60", "--out", str(base),
                        "--vocab", "128", "--vocab-out", str(out), "--quiet"],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert "already prepared" in r.stdout and "vocabulary gpt2-top128 (127 GPT-2 ids + 'other')" in r.stdout, r.stdout
    v = json.loads((out / "vocab.json").read_text())
    assert (v["K"], v["other"], len(v["ids"]), len(v["counts"])) == (128, 127, 127, 128)
    assert sum(v["counts"]) == v["train_tokens"] == TokenData(base).meta["splits"]["train"]["tokens"]
    assert TokenData(base).n_vocab == 50257                                 # the full folder is untouched
    r = subprocess.run([sys.executable, "-c", "import sys; from altgrad.data import prepare_cli; sys.exit(prepare_cli())",
                        "--out", str(base), "--vocab-out", str(out), "--quiet"], capture_output=True, text=True)
    assert r.returncode == 2 and "--vocab-out needs --vocab K" in r.stderr, r.stderr


def test_unigram_baseline_is_on_the_vocabulary(data):
    base, top = data
    td = TokenData(top)
    assert (td.n_vocab, td.vocab, vocab_info(top)["size"]) == (K, f"gpt2-top{K}", K)
    c = np.bincount(td["train"], minlength=K) + 1.0
    val = np.asarray(td["val"], np.int64)
    assert unigram_baseline(top) == pytest.approx(-np.log(c[val] / c.sum()).mean(), abs=1e-9)
    assert unigram_baseline(top) < unigram_baseline(base)


def test_trainer_runs_on_the_compact_vocabulary(tmp_path, data):
    from altgrad.config import load_config
    from altgrad.trainer import Trainer
    _, top = data
    cfg = load_config("smoke", data_dir=str(top), out_dir=str(tmp_path / "run"), vocab_size=K, fmt="E4M3", shadow=False,
                      max_steps=2, eval_interval=2, eval_iters=1, wandb_mode="disabled")
    t = Trainer(cfg, progress=False)
    assert t.model.lm_head.weight.shape == (K, cfg.n_embd)
    m = t.train_step()
    assert math.isfinite(m["train/loss"]) and abs(m["train/loss"] - math.log(K)) < 0.5   # near-uniform over K classes at init
    x, _ = t.data.get_batch("train", cfg.block_size, cfg.batch_size)
    assert int(x.max()) < K
    cs = t.model.compute_split()                                             # the quantized blocks, not the tied head
    assert len(cs["layers_8bit"]) == 4 * cfg.n_layer and "lm_head" not in cs["layers_8bit"]
    assert cs["params_8bit"] == 12 * cfg.n_layer * cfg.n_embd ** 2
    with pytest.raises(ValueError, match="vocab_size=128"):               # ConfigError (a ValueError) or data_for_vocab's error
        Trainer(load_config("smoke", data_dir=str(top), out_dir=str(tmp_path / "r2"), vocab_size=128, wandb_mode="disabled"), progress=False)


def test_study_shape_puts_the_compute_in_8_bits():
    "The proposed study shape: >= 50% of parameters and of matmul FLOPs in the 8-bit layers at K = 4096."
    from altgrad.model import GPT, GPTConfig
    with torch.device("meta"):
        full = GPT(GPTConfig(block_size=64, vocab_size=50304, n_layer=4, n_head=4, n_embd=128)).compute_split()
        top = GPT(GPTConfig(block_size=64, vocab_size=4096, n_layer=4, n_head=4, n_embd=128)).compute_split()
    assert full["param_share"] < 0.5 and full["flop_share"] < 0.5
    assert top["param_share"] >= 0.5 and top["flop_share"] >= 0.5
