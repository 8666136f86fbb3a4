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
