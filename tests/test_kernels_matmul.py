"""The batch-invariant matmul (`--deterministic`): values against its twin, and every row
bitwise the row computed alone, at every M and every place in the batch."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: run the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton kernels need the triton package")

from draftgraph.kernels import matmul as MM  # noqa: E402
from draftgraph.kernels._triton import compiled_for_cpu_missing  # noqa: E402

if compiled_for_cpu_missing(MM._dot_kernel):
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set "
                "(set it in the environment to run them on CPU)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# N = 50, K = 200: an N tail; 16-row tiles so M = 20 spans two row blocks; K in 64-wide tiles
# (a K tail), whole or in 2 chunks of 128 (the second one short)
N, K = 50, 200
CFGS = {"one_chunk": MM.DotConfig(16, 32, 64, 1, 4, 1),
        "split_k": MM.DotConfig(16, 32, 64, 2, 4, 1)}


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def dtypes():
    return [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("cfg", sorted(CFGS))
@pytest.mark.parametrize("with_bias,with_residual", [(False, False), (True, True)])
def test_dot_linear_matches_twin(dtype, cfg, with_bias, with_residual):
    m = 20
    x = randn(m, K, dtype=dtype)
    w = randn(N, K, dtype=dtype, seed=1, scale=K ** -0.5)
    bias = randn(N, dtype=dtype, seed=2) if with_bias else None
    res = randn(m, N, dtype=dtype, seed=3) if with_residual else None
    y = MM.dot_linear(x, w, bias, res, config=CFGS[cfg])
    assert y.shape == (m, N) and y.dtype == dtype
    torch.testing.assert_close(y.float(), MM.dot_linear_ref(x, w, bias, res).float(),
                               atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("cfg", sorted(CFGS))
def test_dot_linear_fp32_out_and_batch_dims(cfg):
    x = randn(2, 3, K, dtype=torch.float16)
    w = randn(N, K, dtype=torch.float16, seed=1, scale=K ** -0.5)
    y = MM.dot_linear(x, w, out_dtype=torch.float32, config=CFGS[cfg])
    assert y.shape == (2, 3, N) and y.dtype == torch.float32
    torch.testing.assert_close(y, MM.dot_linear_ref(x, w, out_dtype=torch.float32),
                               atol=1e-4, rtol=1e-4)
    assert MM.dot_linear(x[:, :0], w).shape == (2, 0, N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cfg", sorted(CFGS))
def test_rows_do_not_depend_on_the_batch(dtype, cfg):
    """Row i of an M-row product is bitwise row i computed alone, among other rows at another
    place, or with different batch-mates: for M = 1 ... 20 (one and two row blocks)."""
    w = randn(N, K, dtype=dtype, seed=1, scale=K ** -0.5)
    bias = randn(N, dtype=dtype, seed=2)
    x = randn(20, K, dtype=dtype, seed=4)
    full = MM.dot_linear(x, w, bias, config=CFGS[cfg])
    for i in (0, 5, 17, 19):
        alone = MM.dot_linear(x[i : i + 1], w, bias, config=CFGS[cfg])
        assert torch.equal(full[i], alone[0]), i
    for m in (2, 5, 16):
        mates = torch.cat([randn(m - 1, K, dtype=dtype, seed=5 + m), x[7:8]])  # row 7 last
        assert torch.equal(MM.dot_linear(mates, w, bias, config=CFGS[cfg])[-1], full[7]), m


def test_split_k_is_a_different_sum():
    """The split changes the order of the sum (so it must never follow M): fp16 inputs with a
    large dynamic range give different fp32 bits for 1 and 2 chunks."""
    x = randn(4, K, dtype=torch.float32, seed=6) * torch.logspace(-3, 3, K, device=DEVICE)
    w = randn(N, K, dtype=torch.float32, seed=1)
    one = MM.dot_linear(x, w, config=CFGS["one_chunk"])
    two = MM.dot_linear(x, w, config=CFGS["split_k"])
    torch.testing.assert_close(one, two, atol=1e-2, rtol=1e-4)
    assert not torch.equal(one, two)


def test_heuristic_config_ignores_m():
    """Configs are keyed by the weight's shape only, and split long K for small-N weights."""
    cfg = MM.dot_config(576, 1536)
    assert cfg == MM.dot_config(576, 1536) and cfg.split_k >= 1
    assert MM.dot_config(4096, 14336).split_k > 1
    assert MM.dot_config(128256, 4096).split_k == 1
    assert MM._k_split(14336, MM.dot_config(4096, 14336)) % 64 == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual,with_bias", [(False, False), (True, True)])
def test_rmsnorm_linear_matches_twin_and_the_unfused_chain(dtype, with_residual, with_bias):
    """The norm inside the matmul: its twin (the same arithmetic) closely, the chain it
    replaces (rms_norm, then the product) within the dtype's rounding, the new residual
    bitwise x + residual; split K is turned off (the norm needs the whole row); rows as
    alone."""
    from draftgraph.kernels.ops import rms_norm_ref

    m = 20
    x = randn(m, K, dtype=dtype, seed=7, scale=3.0)
    res = randn(m, K, dtype=dtype, seed=8) if with_residual else None
    g = randn(K, dtype=dtype, seed=9).abs() + 0.5
    w = randn(N, K, dtype=dtype, seed=1, scale=K ** -0.5)
    bias = randn(N, dtype=dtype, seed=2) if with_bias else None
    for cfg in CFGS.values():  # split_k: run whole
        y, h = MM.dot_rmsnorm_linear(x, g, 1e-5, w, bias, res, config=cfg)
        ref_y, ref_h = MM.dot_rmsnorm_linear_ref(x, g, 1e-5, w, bias, res)
        torch.testing.assert_close(y.float(), ref_y.float(), atol=TOL[dtype], rtol=TOL[dtype])
        assert torch.equal(h, ref_h) and (with_residual or h is x)
        normed, _ = rms_norm_ref(x, g, 1e-5, res)
        chain = MM.dot_linear_ref(normed, w, bias)
        torch.testing.assert_close(y.float(), chain.float(), atol=4 * TOL[dtype],
                                   rtol=4 * TOL[dtype])
        alone = MM.dot_rmsnorm_linear(x[5:6], g, 1e-5, w, bias,
                                      res[5:6] if res is not None else None, config=cfg)[0]
        assert torch.equal(alone[0], y[5])
    # the norm is not a no-op: a scaled input gives the same rows (rms-invariant)
    y2, _ = MM.dot_rmsnorm_linear(x * 4, g, 1e-5, w, bias, res * 4 if res is not None else None,
                                  config=CFGS["one_chunk"])
    torch.testing.assert_close(y2.float(), y.float(), atol=4 * TOL[dtype], rtol=4 * TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cfg", sorted(CFGS))
def test_silu_mul_linear_is_silu_and_mul_then_the_product(dtype, cfg):
    """SwiGLU formed in the matmul's loads: the product of silu(gate) * up (the elementwise
    kernel's formula, rounded to the dtype) with the same config, within a rounding of the
    activation; with a residual too; split K included (a chunk's activation needs only that
    chunk); rows as alone."""
    from draftgraph.kernels.ops import silu_and_mul

    m = 20
    gate_up = randn(m, 2 * K, dtype=dtype, seed=10, scale=2.0)
    w = randn(N, K, dtype=dtype, seed=1, scale=K ** -0.5)
    res = randn(m, N, dtype=dtype, seed=3)
    y = MM.dot_silu_mul_linear(gate_up, w, res, config=CFGS[cfg])
    chain = MM.dot_linear(silu_and_mul(gate_up), w, residual=res, config=CFGS[cfg])
    torch.testing.assert_close(y.float(), chain.float(), atol=4 * TOL[dtype],
                               rtol=4 * TOL[dtype])
    assert torch.equal(MM.dot_silu_mul_linear(gate_up[3:4], w, res[3:4], config=CFGS[cfg])[0],
                       y[3])
    torch.testing.assert_close(y.float(), MM.dot_silu_mul_linear_ref(gate_up, w, res).float(),
                               atol=TOL[dtype], rtol=TOL[dtype])
    y32 = MM.dot_silu_mul_linear(gate_up, w, out_dtype=torch.float32, config=CFGS[cfg])
    assert y32.dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU stand-in of the CUDA dispatch")
def test_a_model_layer_takes_the_fused_forms_on_its_rows(monkeypatch):
    """A decoder layer's rows in the tensor-core range run the norm and SwiGLU inside the
    matmul (two fused norms and one SwiGLU a layer) and give the tokens of the unfused
    chain: the tiny model's greedy output with every 2-64 row product routed to the fused
    forms (here on CPU tensors, under the interpreter) equals its output without."""
    from _tiny import tiny_engine, tiny_hf_model

    from draftgraph.engine.sampling import SamplingParams
    from draftgraph.kernels import gemv

    hf = tiny_hf_model()
    prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6, 11, 12], [3, 1, 4, 1, 5, 9, 2, 6]]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def generate():
        return [o.token_ids for o in tiny_engine(hf).generate(prompts, sp)]

    plain = generate()
    calls = {"norm": 0, "silu": 0}
    norm, silu = MM.dot_rmsnorm_linear, MM.dot_silu_mul_linear

    def counted(name, fn):
        def call(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return call

    monkeypatch.setattr(gemv, "_dot_fuses", lambda x, w, m: 2 <= m <= 64)
    monkeypatch.setattr(MM, "dot_rmsnorm_linear", counted("norm", norm))
    monkeypatch.setattr(MM, "dot_silu_mul_linear", counted("silu", silu))
    fused = generate()
    layers = hf.config.num_hidden_layers
    # (a CPU prefill of more rows splits its MLP: gate and up apart, so norms outnumber)
    assert calls["norm"] >= 2 * layers and calls["silu"] >= layers
    assert fused == plain
