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


# ---- the paired epilogues (SwiGLU, RoPE + KV store), split-K's combine, the two sides ------


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("cfg", sorted(CFGS))
def test_dot_swiglu_matches_twin(dtype, cfg):
    inter = 24  # 2I = 48 weight rows; pairs (c, c + 24) split over column tiles
    x = randn(20, K, dtype=dtype)
    w = randn(2 * inter, K, dtype=dtype, seed=1, scale=K ** -0.5)
    act = MM.dot_swiglu(x, w, config=CFGS[cfg])
    assert act.shape == (20, inter)
    torch.testing.assert_close(act.float(), MM.dot_swiglu_ref(x, w).float(), atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("cfg", sorted(CFGS))
def test_dot_qkv_rope_matches_twin_with_its_kv_stores(dtype, cfg):
    hq, hkv, hd, t = 4, 2, 16, 7
    x = randn(t, K, dtype=dtype)
    w = randn((hq + 2 * hkv) * hd, K, dtype=dtype, seed=1, scale=K ** -0.5)
    bias = randn(w.shape[0], dtype=dtype, seed=2)
    freqs = torch.outer(torch.arange(64.0), 1e4 ** -(torch.arange(0, hd, 2) / hd))
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)  # [max_pos, hd]
    positions = torch.tensor([0, 3, 9, 10, 33, 34, 63], device=DEVICE)
    loc = torch.tensor([5, 1, 7, 2, 9, 3, 0], device=DEVICE)
    caches = [torch.zeros(12, hkv, hd, dtype=dtype, device=DEVICE) for _ in range(4)]
    qkv = MM.dot_qkv_rope(x, w, bias, positions, cos_sin, caches[0], caches[1], loc, hq, hkv,
                          config=CFGS[cfg])
    qkv_ref = MM.dot_qkv_rope_ref(x, w, bias, positions, cos_sin, caches[2], caches[3], loc,
                                  hq, hkv)
    tol = dict(atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(qkv.float(), qkv_ref.float(), **tol)
    torch.testing.assert_close(caches[0].float(), caches[2].float(), **tol)  # k slots
    torch.testing.assert_close(caches[1].float(), caches[3].float(), **tol)  # v slots
    assert caches[0][loc].abs().sum() > 0 and not caches[0][[4, 6, 8, 10, 11]].any()


@pytest.mark.parametrize("cfg", sorted(CFGS))
def test_paired_rows_do_not_depend_on_the_batch(cfg):
    """SwiGLU's pairs and split-K's combine are per row: row i of an M-row call is bitwise
    row i alone or among other batch-mates."""
    x = randn(20, K, dtype=torch.float16)
    w = randn(48, K, dtype=torch.float16, seed=1, scale=K ** -0.5)
    act = MM.dot_swiglu(x, w, config=CFGS[cfg])
    for i in (0, 7, 19):
        assert torch.equal(MM.dot_swiglu(x[i : i + 1], w, config=CFGS[cfg])[0], act[i]), i
    mates = torch.cat([randn(4, K, dtype=torch.float16, seed=16), x[7:8]])
    assert torch.equal(MM.dot_swiglu(mates, w, config=CFGS[cfg])[-1], act[7])


def test_split_k_adds_every_chunk_in_order():
    """Split-K's partials are added by the second launch in chunk order: the one-chunk sum to
    rounding (a combine that dropped a chunk would be far off), the same bits every launch."""
    x = randn(20, K, dtype=torch.float32)
    w = randn(48, K, dtype=torch.float32, seed=1, scale=K ** -0.5)
    runs = [MM.dot_swiglu(x, w, config=CFGS["split_k"]) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    torch.testing.assert_close(runs[0], MM.dot_swiglu(x, w, config=CFGS["one_chunk"]),
                               atol=1e-5, rtol=1e-5)
