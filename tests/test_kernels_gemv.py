"""Fused small-M projection kernels (gemv, rmsnorm_gemv, silu_mul_gemv) vs their torch twins."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # CPU: run the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton kernels need the triton package")

from draftgraph.kernels import gemv as G  # noqa: E402
from draftgraph.kernels._triton import compiled_for_cpu_missing  # noqa: E402
from draftgraph.kernels.ops import rms_norm_ref, silu_and_mul_ref  # noqa: E402

if compiled_for_cpu_missing(G._gemv_kernel):
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set "
                "(set it in the environment to run them on CPU)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
# N = 50 and K = 80 are not powers of two: column tail (N % 16) and K tail (K % 32) both masked
N, K = 50, 80
SMALL = {  # single-row tiles (block_n 16, block_k 32: several K steps, a K and an N tail),
    # every row in its own accumulator: the path the dispatch takes at every M
    m: G.GemvConfig(1, 16, 32) for m in (1, 2, 3, 8)
}


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


def weight(n=N, k=K, dtype=torch.float32, seed=1):
    return randn(n, k, dtype=dtype, seed=seed, scale=k ** -0.5)  # outputs of order 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("with_bias,with_residual", [(False, False), (True, True)])
def test_gemv_matches_reference(dtype, m, with_bias, with_residual):
    x = randn(m, K, dtype=dtype)
    w = weight(dtype=dtype)
    bias = randn(N, dtype=dtype, seed=2) if with_bias else None
    residual = randn(m, N, dtype=dtype, seed=3) if with_residual else None
    x_before = x.clone()
    y = G.gemv_triton(x, w, bias, residual, config=SMALL[m])
    assert y.shape == (m, N) and y.dtype == dtype
    close(y, G.gemv_ref(x, w, bias, residual), dtype)
    expected = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    if residual is not None:
        expected = expected + residual.float()
    close(y, expected, dtype)  # the twin is the plain linear
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [2, 8])
def test_gemv_default_config_matches_reference(dtype, m):
    # the shape table's own choice (fp16 at 8 rows: the tensor-core path)
    x, w = randn(m, 64, dtype=dtype), weight(48, 64, dtype=dtype)
    close(G.gemv_triton(x, w), G.gemv_ref(x, w), dtype)


def test_gemv_tensor_core_path_matches_reference():
    # rows padded to 16 for tl.dot (16-bit weights only); K = 80 leaves a tail of 16
    x, w = randn(3, K, dtype=torch.float16), weight(dtype=torch.float16)
    residual = randn(3, N, dtype=torch.float16, seed=3)
    cfg = G.GemvConfig(16, 16, 32, use_dot=True)
    close(G.gemv_triton(x, w, residual=residual, config=cfg),
          G.gemv_ref(x, w, residual=residual), torch.float16)


def test_gemv_rows_beyond_one_block_are_all_computed():
    # 7 rows in row blocks of 2: the grid's second axis covers them, the last rows included
    x, w = randn(7, K), weight()
    y = G.gemv_triton(x, w, config=G.GemvConfig(2, 16, 32))
    close(y, G.gemv_ref(x, w), torch.float32)


def test_gemv_keeps_leading_dims_and_writes_into_out():
    x, w = randn(2, 1, K), weight()
    out = torch.full((2, N), 7.0, device=DEVICE)
    y = G.gemv_triton(x, w, out=out, config=SMALL[2])
    assert y.shape == (2, 1, N)
    assert y.data_ptr() == out.data_ptr()  # graph-stable: no new output buffer
    close(out, G.gemv_ref(x.view(2, K), w), torch.float32)


def test_gemv_of_zero_rows_launches_nothing():
    y = G.gemv_triton(randn(0, K), weight())
    assert y.shape == (0, N)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_gemv_equals_rms_norm_then_linear(dtype, m, with_residual):
    x = randn(m, K, dtype=dtype)
    norm_w = randn(K, seed=4) * 0.2 + 1
    w, bias = weight(dtype=dtype), randn(N, dtype=dtype, seed=2)
    residual = randn(m, K, dtype=dtype, seed=3) if with_residual else None
    y, new_residual = G.rmsnorm_gemv_triton(x, norm_w, 1e-6, w, bias, residual, config=SMALL[m])
    ref_y, ref_residual = G.rmsnorm_gemv_ref(x, norm_w, 1e-6, w, bias, residual)
    close(y, ref_y, dtype)
    # the twin is ops.rms_norm_ref followed by a linear
    normed, summed = rms_norm_ref(x, norm_w, 1e-6, residual)
    close(y, F.linear(normed.float(), w.float(), bias.float()), dtype)
    if with_residual:
        # written by the first column block only, yet every row and column of it is there
        assert torch.equal(new_residual, summed)
        assert torch.equal(ref_residual, summed)
    else:
        assert new_residual is x  # first layer: the residual is the input itself


@pytest.mark.parametrize("m,cfg", [(1, G.GemvConfig(1, 8, 64)),
                                   (5, G.GemvConfig(16, 16, 64, use_dot=True))])
def test_rms_prologue_over_rows_wider_than_one_load(m, cfg):
    # K = 600 needs 1 prologue load at BLOCK_M 1 and 3 at BLOCK_M 16 (norm_block 256)
    k = 600
    assert G.norm_block(k, cfg.block_m, cfg.block_k) == (1024 if m == 1 else 256)
    dtype = torch.float16 if cfg.use_dot else torch.float32  # tl.dot of fp32 is tf32 on GPUs
    x = (randn(m, k) * torch.linspace(0.1, 5, k, device=DEVICE)).to(dtype)
    residual = randn(m, k, dtype=dtype, seed=3)
    norm_w = randn(k, seed=4) * 0.2 + 1
    w = weight(48, k, dtype=dtype)
    y, new_residual = G.rmsnorm_gemv_triton(x, norm_w, 1e-6, w, None, residual, config=cfg)
    ref_y, ref_residual = G.rmsnorm_gemv_ref(x, norm_w, 1e-6, w, None, residual)
    close(y, ref_y, dtype)
    assert torch.equal(new_residual, ref_residual)


def test_rmsnorm_gemv_norm_uses_the_full_row_in_every_column_block():
    # 4 column blocks each recompute the rms; a block seeing only its K slice would be wrong
    x = randn(2, K) * torch.linspace(0.1, 5, K, device=DEVICE)
    norm_w = torch.ones(K, device=DEVICE)
    w = weight(64, K)
    y, _ = G.rmsnorm_gemv_triton(x, norm_w, 1e-6, w, config=G.GemvConfig(2, 16, 16))
    close(y, G.rmsnorm_gemv_ref(x, norm_w, 1e-6, w)[0], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("with_residual", [False, True])
def test_silu_mul_gemv_equals_silu_and_mul_then_linear(dtype, m, with_residual):
    gate_up = randn(m, 2 * K, dtype=dtype)
    w = weight(dtype=dtype)
    residual = randn(m, N, dtype=dtype, seed=3) if with_residual else None
    y = G.silu_mul_gemv_triton(gate_up, w, residual, config=SMALL[m])
    close(y, G.silu_mul_gemv_ref(gate_up, w, residual), dtype)
    expected = F.linear(silu_and_mul_ref(gate_up.float()), w.float())
    if residual is not None:
        expected = expected + residual.float()
    close(y, expected, dtype)


def test_fused_kernels_take_single_rows_on_cuda_and_more_for_exact_weights():
    from types import SimpleNamespace

    cuda_weight = SimpleNamespace(is_cuda=True)  # pays() reads is_cuda and the mark alone
    assert G.pays(1, cuda_weight) and G.pays(G.GEMV_MAX_M, cuda_weight)
    assert not G.pays(G.GEMV_MAX_M + 1, cuda_weight)
    assert not G.pays(0, cuda_weight)
    assert not G.pays(1, SimpleNamespace(is_cuda=False))
    marked = SimpleNamespace(is_cuda=True, **{G.EXACT_ROWS_ATTR: G.EXACT_ROWS_MAX_M})
    assert G.pays(G.EXACT_ROWS_MAX_M, marked) and not G.pays(G.EXACT_ROWS_MAX_M + 1, marked)


def test_tensor_core_rows_take_marked_weights_within_their_row_range():
    from types import SimpleNamespace

    lin = torch.nn.Linear(4, 3, bias=False)
    cuda_x, cpu_x = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    assert not any(G._dot(cuda_x, lin.weight, m) for m in (1, 2, 64))  # unmarked: cuBLAS
    G.mark_dot_rows(lin, (2, 8))
    assert [G._dot(cuda_x, lin.weight, m) for m in (1, 2, 8, 9)] == [False, True, True, False]
    G.mark_dot_rows(lin, (1, 16))  # a lone row keeps the fused kernels whatever the range
    assert [G._dot(cuda_x, lin.weight, m) for m in (1, 8, 9, 17)] == [False, True, True, False]
    assert not G._dot(cpu_x, lin.weight, 9)  # CUDA only
    G.mark_dot_rows(lin, None)
    assert not G._dot(cuda_x, lin.weight, 9)
    invariant = SimpleNamespace(**{G.INVARIANT_ATTR: True})  # --deterministic: every M
    assert G._dot(cuda_x, invariant, 1) and G._dot(cuda_x, invariant, 500)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU dispatch")
def test_cpu_dispatch_runs_the_unfused_chain_equal_to_the_twins():
    x, w, norm_w = randn(2, K), weight(), randn(K, seed=4)
    residual, gate_up = randn(2, K, seed=3), randn(2, 2 * K, seed=5)
    assert torch.equal(G.gemv(x, w), G.gemv_ref(x, w))
    # out_dtype fp32 keeps a bf16 product unrounded
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    y32 = G.gemv(xb, wb, out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32, xb.float() @ wb.float().t())
    assert not torch.equal(y32, G.gemv(xb, wb).float())
    y, res = G.rmsnorm_gemv(x, norm_w, 1e-6, w, residual=residual)
    ref_y, ref_res = G.rmsnorm_gemv_ref(x, norm_w, 1e-6, w, residual=residual)
    assert torch.equal(y, ref_y) and torch.equal(res, ref_res)
    assert torch.equal(G.silu_mul_gemv(gate_up, w), G.silu_mul_gemv_ref(gate_up, w))


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (49152, 576), (4096, 14336),
                                 (28672, 4096), (128256, 4096)])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_default_config_fits_the_kernel(n, k, m):
    cfg = G.default_config("plain", m, n, k, torch.bfloat16)
    for block in (cfg.block_m, cfg.block_n, cfg.block_k):
        assert block & (block - 1) == 0  # powers of two (tl.arange)
    assert cfg.block_m >= m or m > 8
    if cfg.use_dot:
        assert min(cfg.block_m, cfg.block_n, cfg.block_k) >= 16  # tl.dot's minimum tile
    assert cfg.block_k <= max(16, 1 << (k - 1).bit_length())


def test_tuned_table_overrides_the_heuristic(monkeypatch):
    tuned = G.GemvConfig(1, 2, 64, 1, 1, False)
    monkeypatch.setitem(G.TUNED, ("silu", 576, 1536, 1), tuned)
    assert G._config(G._SILU, 576, 1536, torch.bfloat16) == tuned  # every M: the M = 1 entry
    assert G._config(G._PLAIN, 576, 1536, torch.bfloat16) != tuned  # other mode: heuristic


@pytest.mark.parametrize("mode", ["plain", "norm", "silu"])
@pytest.mark.parametrize("m", [2, 5, 9])
def test_every_row_is_computed_as_it_would_be_alone(mode, m):
    # fp16, a K tail, single-row tiles: 4 registers per row, so 4 rows per program under the
    # default budget (5 rows in two row blocks, 9 in three). Each row of the batch equals that
    # row alone, bit for bit (on a GPU the claim that makes a verify row a decode row; on CPU
    # the interpreter's arithmetic)
    dtype, cfg = torch.float16, G.GemvConfig(1, 16, 32)
    assert G.rows_per_program(cfg, m) == min(m, 4)
    assert G.rows_per_program(cfg, m, budget=128) == min(m, 8)
    x = randn(m, 2 * K if mode == "silu" else K, dtype=dtype)
    w, norm_w = weight(dtype=dtype), randn(K, seed=4) * 0.2 + 1
    residual = randn(m, K if mode == "norm" else N, dtype=dtype, seed=3)

    def run(rows):
        if mode == "plain":
            return G.gemv_triton(x[rows], w, None, residual[rows], config=cfg)
        if mode == "silu":
            return G.silu_mul_gemv_triton(x[rows], w, residual[rows], config=cfg)
        y, res = G.rmsnorm_gemv_triton(x[rows], norm_w, 1e-6, w, None, residual[rows],
                                       config=cfg)
        return torch.cat([y, res], dim=-1)

    together = run(slice(None))
    for i in range(m):
        assert torch.equal(together[i], run(slice(i, i + 1))[0]), f"row {i}"
    ref = {"plain": lambda: G.gemv_ref(x, w, residual=residual),
           "silu": lambda: G.silu_mul_gemv_ref(x, w, residual),
           "norm": lambda: torch.cat(G.rmsnorm_gemv_ref(x, norm_w, 1e-6, w, None, residual),
                                     dim=-1)}[mode]()
    close(together, ref, dtype)


def test_exact_rows_are_marked_per_model_and_on_for_small_models():
    small = torch.nn.Linear(64, 32)
    big = torch.nn.Linear(32768, 16384, device="meta")  # 2 GiB of fp32 weights
    assert G.wants_exact_rows(small) and not G.wants_exact_rows(big)
    G.mark_exact_rows(small)
    assert getattr(small.weight, G.EXACT_ROWS_ATTR) == G.EXACT_ROWS_MAX_M
    assert not G.pays(2, small.weight)  # a CPU weight never takes the kernels
    G.mark_exact_rows(small, 0)
    assert getattr(small.weight, G.EXACT_ROWS_ATTR) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias,with_residual", [(False, False), (True, True)])
def test_rmsnorm_qkv_rope_equals_norm_linear_rope_and_kv_store(dtype, with_bias, with_residual):
    # one decode token: 3 q heads, 1 kv head of 16 dims; K = 40 needs a K tail (block_k 32)
    hq, hkv, hd, k = 3, 1, 16, 40
    n = (hq + 2 * hkv) * hd
    x = randn(1, k, dtype=dtype)
    norm_w = randn(k, dtype=dtype, seed=4) + 1.0
    w = weight(n, k, dtype=dtype)
    bias = randn(n, dtype=dtype, seed=2) if with_bias else None
    residual = randn(1, k, dtype=dtype, seed=3) if with_residual else None
    theta = 1.0 / (10000 ** (torch.arange(0, hd, 2).double() / hd))
    ang = torch.outer(torch.arange(64).double(), theta)
    cos_sin = torch.cat((ang.cos(), ang.sin()), -1).float().to(DEVICE)  # [64, hd]
    positions = torch.tensor([37], device=DEVICE)
    loc = torch.tensor([5], device=DEVICE)
    caches = [torch.zeros(8, hkv, hd, dtype=dtype, device=DEVICE) for _ in range(4)]
    # 16 pairs per program: 40 pairs in 3 programs, the last one half masked
    cfg = G.GemvConfig(1, 32, 32)
    y, res = G.rmsnorm_qkv_rope_triton(x, norm_w, 1e-6, w, bias, residual, positions, cos_sin,
                                       caches[0], caches[1], loc, hq, hkv, config=cfg)
    y_ref, res_ref = G.rmsnorm_qkv_rope_ref(x, norm_w, 1e-6, w, bias, residual, positions,
                                            cos_sin, caches[2], caches[3], loc, hq, hkv)
    close(y, y_ref, dtype)
    close(res, res_ref, dtype)
    close(caches[0], caches[2], dtype)  # rotated k in slot 5, every other slot untouched
    close(caches[1], caches[3], dtype)
    assert caches[0][5].abs().sum() > 0 and caches[0][:5].abs().sum() == 0
    # the rotation happened: q differs from the unrotated projection
    plain, _ = G.rmsnorm_gemv_ref(x, norm_w, 1e-6, w, bias, residual)
    assert not torch.allclose(y[:, : hq * hd].float(), plain[:, : hq * hd].float(), atol=1e-2)
    close(y[:, -hkv * hd:], plain[:, -hkv * hd:], dtype)  # v passes through


def test_rmsnorm_qkv_rope_of_several_tokens_is_each_token_alone():
    # 5 verify tokens at their own positions and slots; each token's q, k, v and residual
    # equal the same kernel run on that token alone, bit for bit, and the twin's values
    hq, hkv, hd, k, t, dtype = 3, 1, 16, 40, 5, torch.float16
    n = (hq + 2 * hkv) * hd
    x, residual = randn(t, k, dtype=dtype), randn(t, k, dtype=dtype, seed=3)
    norm_w, w = randn(k, dtype=dtype, seed=4) + 1.0, weight(n, k, dtype=dtype)
    theta = 1.0 / (10000 ** (torch.arange(0, hd, 2).double() / hd))
    ang = torch.outer(torch.arange(64).double(), theta)
    cos_sin = torch.cat((ang.cos(), ang.sin()), -1).float().to(DEVICE)
    positions = torch.arange(30, 30 + t, device=DEVICE)
    loc = torch.tensor([7, 2, 9, 4, 11], device=DEVICE)
    cfg = G.GemvConfig(1, 32, 32)

    def run(rows, caches):
        return G.rmsnorm_qkv_rope_triton(x[rows], norm_w, 1e-6, w, None, residual[rows],
                                         positions[rows], cos_sin, *caches, loc[rows], hq, hkv,
                                         config=cfg)

    together = [torch.zeros(16, hkv, hd, dtype=dtype, device=DEVICE) for _ in range(2)]
    y, res = run(slice(None), together)
    alone = [torch.zeros(16, hkv, hd, dtype=dtype, device=DEVICE) for _ in range(2)]
    for i in range(t):
        yi, ri = run(slice(i, i + 1), alone)
        assert torch.equal(y[i], yi[0]) and torch.equal(res[i], ri[0]), f"token {i}"
    assert torch.equal(together[0], alone[0]) and torch.equal(together[1], alone[1])
    ref = [torch.zeros(16, hkv, hd, dtype=dtype, device=DEVICE) for _ in range(2)]
    y_ref, _ = G.rmsnorm_qkv_rope_ref(x, norm_w, 1e-6, w, None, residual, positions, cos_sin,
                                      *ref, loc, hq, hkv)
    close(y, y_ref, dtype)
    close(together[0], ref[0], dtype)


def test_exact_rows_setting_is_checked():
    from draftgraph.config import EngineConfig

    assert EngineConfig(device="cpu").exact_rows == "off"
    with pytest.raises(ValueError, match="--exact-rows must be auto, on or off"):
        EngineConfig(device="cpu", exact_rows="maybe")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs an sm_90+ GPU")
@pytest.mark.parametrize("path", ["decode", "verify", "verify_dot"])
def test_pdl_chain_in_a_graph_equals_plain_launches(monkeypatch, path):
    """A layer's chain of dependent kernels, 8 layers deep, then the LM head and argmax,
    captured with programmatic dependent launch and replayed on fresh inputs, is bitwise the
    same chain launched without it: every kernel waits for the one before (a kernel reading
    before its wait would see the previous replay's values). decode: one row through the
    fused kernels (norm + qkv + RoPE + KV store, decode attention, o + residual, norm +
    gate_up, SwiGLU + down + residual); verify: 4 rows through norm, cuBLAS, RoPE + KV store,
    extend attention and SwiGLU kernels between the cuBLAS projections; verify_dot: the same
    with the tensor-core matmul (kernels/matmul.py, split-K's combine among them) for cuBLAS."""
    from draftgraph.kernels import _triton
    from draftgraph.kernels import matmul as MM
    from draftgraph.kernels.argmax import argmax_lse_triton
    from draftgraph.kernels.attention import decode_attention, extend_attention
    from draftgraph.kernels.elementwise import (
        rms_norm_triton,
        rope_and_store_kv,
        silu_and_mul_triton,
    )

    dt, dev = torch.bfloat16, "cuda"
    hidden, inter, vocab, hq, hkv, hd, slots = 576, 1536, 4096, 9, 3, 64, 64
    rows = 1 if path == "decode" else 4
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)

    layers = [dict(n1=1 + rnd(hidden), qkv=rnd((hq + 2 * hkv) * hd, hidden),
                   o=rnd(hidden, hq * hd), n2=1 + rnd(hidden), gu=rnd(2 * inter, hidden),
                   down=rnd(hidden, inter)) for _ in range(8)]
    lm, nf = rnd(vocab, hidden), 1 + rnd(hidden)
    angle = torch.arange(slots, device=dev)[:, None] * 0.01 * torch.arange(hd // 2, device=dev)
    cos_sin = torch.cat([torch.cos(angle), torch.sin(angle)], -1)
    caches = [tuple(torch.zeros(slots, hkv, hd, dtype=dt, device=dev) for _ in range(2))
              for _ in layers]
    x_in = torch.empty(rows, hidden, dtype=dt, device=dev)
    pos = torch.arange(rows, dtype=torch.int64, device=dev)  # also the KV slots
    qo_indptr = torch.tensor([0, rows], dtype=torch.int32, device=dev)
    indptr = torch.tensor([0, rows], dtype=torch.int32, device=dev)
    indices = torch.arange(slots, dtype=torch.int32, device=dev)
    start = torch.zeros(1, dtype=torch.int32, device=dev)

    def decode_layer(x, res, L, kc, vc):
        qkv, res = G.rmsnorm_qkv_rope_triton(x, L["n1"], 1e-5, L["qkv"], None, res, pos,
                                             cos_sin, kc, vc, pos, hq, hkv)
        attn = torch.empty(1, hq, hd, dtype=dt, device=dev)
        decode_attention(qkv[:, : hq * hd].view(1, hq, hd), kc, vc, indptr, indices, start,
                         pos, None, hd ** -0.5, attn)
        res = G.gemv_triton(attn.view(1, -1), L["o"], residual=res)
        gu, res = G.rmsnorm_gemv_triton(res, L["n2"], 1e-5, L["gu"])
        return G.silu_mul_gemv_triton(gu, L["down"], residual=res)

    lin = MM.dot_linear if path == "verify_dot" else F.linear

    def verify_layer(x, res, L, kc, vc):
        h, res = rms_norm_triton(x, L["n1"], 1e-5, res)
        q, k, v = lin(h, L["qkv"]).split([hq * hd, hkv * hd, hkv * hd], dim=-1)
        q = rope_and_store_kv(q.reshape(rows, hq, hd), k.reshape(rows, hkv, hd),
                              v.reshape(rows, hkv, hd), pos, cos_sin, kc, vc, pos)
        attn = torch.empty(rows, hq, hd, dtype=dt, device=dev)
        extend_attention(q, kc, vc, qo_indptr, indptr, indices, start, pos, None, hd ** -0.5,
                         attn, 1)
        h, res = rms_norm_triton(lin(attn.view(rows, -1), L["o"]), L["n2"], 1e-5,
                                 res if res is not None else x)
        return lin(silu_and_mul_triton(lin(h, L["gu"])), L["down"]) + res

    layer = decode_layer if path == "decode" else verify_layer

    def step():
        x, res = x_in, None
        for L, (kc, vc) in zip(layers, caches, strict=True):
            x = layer(x, res, L, kc, vc)
        h, _ = G.rmsnorm_gemv_triton(x, nf, 1e-5, lm) if path == "decode" else \
            (lin(rms_norm_triton(x, nf, 1e-5)[0], lm), None)
        return argmax_lse_triton(h)

    inputs = [rnd(rows, hidden, scale=1.0) for _ in range(4)]
    monkeypatch.setenv(_triton.PDL_ENV, "0")
    want = []
    for x in inputs:
        x_in.copy_(x)
        want.append(tuple(t.clone() for t in step()))
    monkeypatch.setenv(_triton.PDL_ENV, "1")
    assert _triton.pdl_on(x_in)
    x_in.copy_(inputs[0])
    step()  # compile the PDL variants outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        for x, (am, lse) in zip(inputs, want, strict=True):
            x_in.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out[0], am) and torch.equal(out[1], lse)
