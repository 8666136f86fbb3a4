"""RMSNorm, RoPE, SiLU*mul, KV store and page table kernels vs their torch twins."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: run the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton kernels need the triton package")

from draftgraph.kernels import elementwise as ew  # noqa: E402
from draftgraph.kernels._triton import compiled_for_cpu_missing  # noqa: E402
from draftgraph.kernels.kv_store import store_kv, store_kv_ref  # noqa: E402
from draftgraph.kernels.ops import rms_norm_ref, rope_ref, silu_and_mul_ref  # noqa: E402
from draftgraph.kernels.page_table import build_page_table, build_page_table_ref  # noqa: E402

if compiled_for_cpu_missing(ew._rms_norm_kernel):
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set "
                "(set it in the environment to run them on CPU)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    x = randn(5, 80, dtype=dtype)  # hidden not a power of two
    weight = randn(80, seed=1) + 1
    residual = randn(5, 80, dtype=dtype, seed=2) if with_residual else None
    x_before = x.clone()
    out, new_res = ew.rms_norm_triton(x, weight, 1e-6, residual)
    ref_out, ref_res = rms_norm_ref(x, weight, 1e-6, residual)
    close(out, ref_out, dtype)
    assert out.dtype == dtype
    if with_residual:
        close(new_res, ref_res, dtype)
    else:
        assert new_res is None
    assert torch.equal(x, x_before)  # inputs untouched, like the reference


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_writes_into_a_half_of_a_wider_buffer(with_residual):
    """`out=`: the normed rows land in the view (the chain head's two norms fill the halves of
    its q/k/v input, no concatenation), bit for bit what a fresh output holds; the other half
    untouched."""
    x, weight = randn(5, 80), randn(80, seed=1) + 1
    residual = randn(5, 80, seed=2) if with_residual else None
    buf = torch.full((5, 160), 7.0, device=DEVICE)
    got, res = ew.rms_norm_triton(x, weight, 1e-6, residual, out=buf[:, 80:])
    fresh, fresh_res = ew.rms_norm_triton(x, weight, 1e-6, residual)
    assert got.data_ptr() == buf[:, 80:].data_ptr()
    assert torch.equal(buf[:, 80:], fresh) and (buf[:, :80] == 7.0).all()
    assert (res is None) == (not with_residual) and (res is None or torch.equal(res, fresh_res))


def _cos_sin(max_pos, rot_dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), -1).to(DEVICE)  # [max_pos, rot_dim] fp32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot_dim", [64, 32])  # full and partial rotary
@pytest.mark.parametrize("inplace", [False, True])
def test_rope_matches_reference(dtype, rot_dim, inplace):
    num_tokens, hq, hkv, d = 4, 6, 2, 64
    qkv = randn(num_tokens, (hq + 2 * hkv) * d, dtype=dtype)  # q, k are strided views
    q = qkv[:, : hq * d].view(num_tokens, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(num_tokens, hkv, d)
    positions = torch.tensor([0, 7, 3, 50], device=DEVICE)
    cache = _cos_sin(64, rot_dim)
    ref_q, ref_k = rope_ref(q, k, positions, cache)
    out_q, out_k = ew.rope_triton(q, k, positions, cache, inplace=inplace)
    close(out_q, ref_q, dtype)
    close(out_k, ref_k, dtype)
    if inplace:
        assert out_q.data_ptr() == q.data_ptr()
        close(q, ref_q, dtype)
    else:
        assert not torch.equal(q.float(), ref_q.float())  # input left as it was


@pytest.mark.parametrize("rot_dim", [64, 32])
def test_rope_and_store_kv_matches_rope_then_store(rot_dim):
    num_tokens, hq, hkv, d = 3, 6, 2, 64
    qkv = randn(num_tokens, (hq + 2 * hkv) * d, dtype=torch.float16)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = (x.view(num_tokens, -1, d) for x in (q, k, v))
    positions = torch.tensor([4, 0, 33], device=DEVICE)
    out_cache_loc = torch.tensor([7, 1, 12], device=DEVICE)
    cache = _cos_sin(64, rot_dim)
    caches = [torch.zeros(16, hkv, d, dtype=torch.float16, device=DEVICE) for _ in range(4)]
    ref_q, ref_k = rope_ref(q, k, positions, cache)
    store_kv_ref(ref_k, v, caches[0], caches[1], out_cache_loc)
    out_q = ew.rope_and_store_kv(q, k, v, positions, cache, caches[2], caches[3], out_cache_loc)
    close(out_q, ref_q, torch.float16)
    close(caches[2], caches[0], torch.float16)
    assert torch.equal(caches[3], caches[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype):
    gate_up = randn(2, 3, 200, dtype=dtype)  # I = 100, leading dims kept
    out = ew.silu_and_mul_triton(gate_up)
    assert out.shape == (2, 3, 100)
    close(out, silu_and_mul_ref(gate_up), dtype)


@pytest.mark.parametrize("cache_dtype", DTYPES)
def test_store_kv_matches_reference(cache_dtype):
    num_tokens, hkv, d = 5, 3, 64
    kv = randn(num_tokens, 2 * hkv * d)  # k and v as strided views of one projection
    k = kv[:, : hkv * d].view(num_tokens, hkv, d)
    v = kv[:, hkv * d :].view(num_tokens, hkv, d)
    out_cache_loc = torch.tensor([9, 2, 30, 31, 17], device=DEVICE)
    caches = {}
    for name, fn in (("ref", store_kv_ref), ("tri", store_kv)):
        k_cache = torch.full((40, hkv, d), 7.0, dtype=cache_dtype, device=DEVICE)
        v_cache = torch.full((40, hkv, d), 7.0, dtype=cache_dtype, device=DEVICE)
        fn(k, v, k_cache, v_cache, out_cache_loc)
        caches[name] = (k_cache, v_cache)
    assert torch.equal(caches["ref"][0], caches["tri"][0])
    assert torch.equal(caches["ref"][1], caches["tri"][1])


@pytest.mark.parametrize("page_size", [4, 16])
def test_page_table_matches_reference(page_size):
    gen = torch.Generator().manual_seed(page_size)
    max_ctx, rows = 160, 5
    # each request owns whole pages, positions fill them in order
    pages = torch.randperm(200, generator=gen)[: rows * (max_ctx // page_size)] + 1
    pages = pages.view(rows, -1)
    req_to_token = (pages.repeat_interleave(page_size, 1) * page_size
                    + torch.arange(max_ctx) % page_size).to(DEVICE)  # [rows, max_ctx] int64
    req_pool_indices = torch.tensor([3, 0, 4, 1], device=DEVICE)
    seq_lens = torch.tensor([0, 1, page_size * 9 + 1, max_ctx], device=DEVICE)  # 0 and many pages
    tables = {}
    for name, fn in (("ref", build_page_table_ref), ("tri", build_page_table)):
        table = torch.full((6, max_ctx // page_size + 2), -5, dtype=torch.int64, device=DEVICE)
        fn(req_pool_indices, seq_lens, req_to_token, page_size, table)
        tables[name] = table
    assert torch.equal(tables["ref"], tables["tri"])
    assert tables["tri"][2, 9] == pages[4, 9]  # the page of position 9 * page_size
    assert (tables["tri"][0] == -5).all()  # empty request: nothing written


@pytest.mark.parametrize("tokens", [1, 5, 200])  # the table form up to ROPE_TABLE_MAX_T
def test_cpu_rope_and_rms_norm_are_the_two_half_form_and_the_reference_bit_for_bit(tokens):
    """The CPU paths: RoPE through one forward's tables (x * cos + roll(x) * signed sin) gives
    the two-half form's bits, the tables built once per memo (one forward) and cache; the
    fp32 RMSNorm through torch's own gives `rms_norm_ref`'s bits, with and without residual."""
    from draftgraph.kernels import ops

    g = torch.Generator().manual_seed(tokens)
    d, half = 64, 32
    cache = torch.randn(4096, d, generator=g)
    q, k = torch.randn(tokens, 6, d, generator=g), torch.randn(tokens, 2, d, generator=g)
    pos = torch.randint(0, 4096, (tokens,), generator=g)
    cos, sin = cache[pos][:, None, :half], cache[pos][:, None, half:]

    def two_half(x):
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    memo = {}
    for _ in range(2):  # a second layer of the same forward
        got = ops.rope(q, k, pos, cache, memo)
        assert torch.equal(got[0], two_half(q)) and torch.equal(got[1], two_half(k))
    assert len(memo) == (1 if tokens <= ops.ROPE_TABLE_MAX_T else 0)
    x, w, res = (torch.randn(tokens, 576, generator=g) for _ in range(3))
    for r in (None, res):
        a, ra = ops.rms_norm(x, w[0], 1e-6, r)
        b, rb = rms_norm_ref(x, w[0], 1e-6, r)
        assert torch.equal(a, b) and (r is None and ra is None or torch.equal(ra, rb))
