"""The batch-invariant matmul (`--deterministic`): values against its twin, and every row
bitwise the row computed alone, at every M and every place in the batch."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: run the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton kernels need the triton package")

from draftgraph.kernels import gemv as G  # noqa: E402
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


# ---- epilogues: SwiGLU in the product, the next norm in the K-chunk combine ---------------


@pytest.mark.parametrize("dtype", dtypes())
def test_silu_mul_epilogue_is_bitwise_the_product_then_silu_and_mul(dtype):
    from draftgraph.kernels.elementwise import silu_and_mul_triton

    inter = 40  # [gate | up] of 2 x 40 rows: a column tail in each half
    x = randn(20, K, dtype=dtype, seed=7)
    w = randn(2 * inter, K, dtype=dtype, seed=8, scale=K ** -0.5)
    cfg = CFGS["one_chunk"]
    y = MM.dot_linear(x, w, silu_mul=True, config=cfg)
    assert y.shape == (20, inter)
    assert torch.equal(y, silu_and_mul_triton(MM.dot_linear(x, w, config=cfg)))
    torch.testing.assert_close(y.float(), MM.dot_linear_ref(x, w, silu_mul=True).float(),
                               atol=TOL[dtype], rtol=TOL[dtype])
    # the up half is read: a changed up row changes its column
    w2 = w.clone()
    w2[inter + 3] += 1
    assert not torch.equal(MM.dot_linear(x, w2, silu_mul=True, config=cfg)[:, 3], y[:, 3])
    with pytest.raises(ValueError, match="one-chunk config"):
        MM.dot_linear(x, w, silu_mul=True, config=CFGS["split_k"])


@pytest.mark.parametrize("dtype", dtypes())
def test_norm_in_the_combine_is_bitwise_the_product_then_rms_norm(dtype):
    from draftgraph.kernels.elementwise import rms_norm_triton

    x = randn(20, K, dtype=dtype, seed=9)
    w = randn(N, K, dtype=dtype, seed=10, scale=K ** -0.5)
    res = randn(20, N, dtype=dtype, seed=11)
    norm_w = randn(N, dtype=dtype, seed=12)
    cfg = CFGS["split_k"]
    normed, new_res = MM.dot_linear_rmsnorm(x, w, res, norm_w, 1e-5, config=cfg)
    want_normed, want_res = rms_norm_triton(MM.dot_linear(x, w, config=cfg), norm_w, 1e-5, res)
    assert torch.equal(new_res, want_res) and torch.equal(normed, want_normed)
    ref_normed, ref_res = MM.dot_linear_rmsnorm_ref(x, w, res, norm_w, 1e-5)
    torch.testing.assert_close(normed.float(), ref_normed.float(), atol=5 * TOL[dtype],
                               rtol=5 * TOL[dtype])
    torch.testing.assert_close(new_res.float(), ref_res.float(), atol=TOL[dtype],
                               rtol=TOL[dtype])
    with pytest.raises(ValueError, match="several chunks"):
        MM.dot_linear_rmsnorm(x, w, res, norm_w, 1e-5, config=CFGS["one_chunk"])


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("with_bias", [False, True])
def test_rope_epilogue_is_bitwise_the_product_then_rope_and_store_kv(dtype, with_bias):
    """qkv's epilogue (a program per head, its halves in two accumulators) rotates q and k by
    each row's position and stores k and v into their slots: bitwise `dot_linear` followed
    by `rope_and_store_kv`, every q, k and v element."""
    from draftgraph.kernels.elementwise import rope_and_store_kv

    hq, hkv, d, m = 3, 1, 32, 20
    n = (hq + 2 * hkv) * d  # 160 columns, K = 200: a K tail
    cfg = MM.DotConfig(16, d // 2, 64, 1, 4, 1)
    x = randn(m, K, dtype=dtype, seed=13)
    w = randn(n, K, dtype=dtype, seed=14, scale=K ** -0.5)
    bias = randn(n, dtype=dtype, seed=15) if with_bias else None
    cos_sin = randn(64, d, seed=16)  # fp32 [max_pos, rot_dim]: cos | sin
    positions = torch.randint(0, 64, (m,), generator=torch.Generator().manual_seed(17)).to(
        DEVICE)
    out_cache_loc = torch.randperm(40, generator=torch.Generator().manual_seed(18))[:m].to(
        DEVICE)
    caches = [torch.zeros(40, hkv, d, dtype=dtype, device=DEVICE) for _ in range(4)]
    q = MM.dot_qkv_rope_store(x, w, bias, positions, cos_sin, caches[0], caches[1],
                              out_cache_loc, hq, hkv, config=cfg)
    qkv = MM.dot_linear(x, w, bias, config=cfg)
    qs, ks, vs = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    want = rope_and_store_kv(qs.reshape(m, hq, d), ks.reshape(m, hkv, d),
                             vs.reshape(m, hkv, d), positions, cos_sin, caches[2], caches[3],
                             out_cache_loc)
    assert q.shape == (m, hq, d)
    assert torch.equal(q, want)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0][out_cache_loc].abs().amin(-1).gt(0).all()  # every row's k stored
    assert not torch.equal(q.reshape(m, -1), qs)  # rotated
    with pytest.raises(ValueError, match="half a head"):
        MM.dot_qkv_rope_store(x, w, bias, positions, cos_sin, caches[0], caches[1],
                              out_cache_loc, hq, hkv, config=MM.DotConfig(16, 32, 64, 1, 4, 1))


def _dot_anywhere(x, weight, m):
    """gemv._dot without its CUDA check: CPU rows take the matmul (in the interpreter)."""
    rows = getattr(weight, G.DOT_ROWS_ATTR, None)
    return rows is not None and max(2, rows[0]) <= m <= rows[1]


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU rows in the interpreter; on the GPU: "
                    "test_gpu_tensor_core_rows.py")
@pytest.mark.parametrize("variant", ["plain", "head", "rope", "split_gate_up"])
def test_layers_on_the_matmul_fold_swiglu_and_the_next_norm_into_its_epilogues(
        monkeypatch, variant):
    """A tiny model's prefill rows on the tensor-core matmul (CPU rows routed to it): every
    layer's SwiGLU runs in gate_up's epilogue and every layer but the last normalizes the next
    one's input in down's combine; the generated tokens, with a chain head the target's
    captured streams (the residual itself after a fused norm, x + residual elsewhere) of the
    prefill, and with the Triton attention backend and `DOT_ROPE` every layer's RoPE and KV
    store in qkv's epilogue, equal the unfused chain's. split_gate_up: gate_up summed in K
    chunks takes no SwiGLU epilogue, and down's combine still normalizes (SwiGLU apart)."""
    with_head, rope, split = variant == "head", variant == "rope", variant == "split_gate_up"
    from _tiny import tiny_hf_model, tiny_loaded

    from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from draftgraph.engine.engine import LLMEngine
    from draftgraph.engine.sampling import SamplingParams
    from draftgraph.models.heads import random_head
    from draftgraph.spec.chain_head import ChainHeadDrafter

    monkeypatch.setattr(G, "_dot", _dot_anywhere)
    hf = tiny_hf_model()
    hidden, inter = hf.config.hidden_size, hf.config.intermediate_size
    # the tiny down projection ([64, 96]) summed in 2 K chunks, as SmolLM2's is in 4
    monkeypatch.setitem(MM.DOT_TUNED, (hidden, inter), MM.DotConfig(16, 32, 32, 2, 4, 1))
    # qkv ([128, 64]: 8 heads of 16) in tiles of half a head
    heads = hf.config.num_attention_heads + 2 * hf.config.num_key_value_heads
    head_dim = hidden // hf.config.num_attention_heads
    monkeypatch.setitem(MM.DOT_TUNED, (heads * head_dim, hidden),
                        MM.DotConfig(16, head_dim // 2, 32, 1, 4, 1))
    if split:
        monkeypatch.setitem(MM.DOT_TUNED, (2 * inter, hidden), MM.DotConfig(16, 32, 32, 2, 4, 1))
    monkeypatch.setattr(G, "DOT_ROPE", rope)
    calls = {"silu_mul": 0, "norm": 0, "rope": 0}

    def spy(name, fn):
        def wrapped(*a, **kw):
            out = fn(*a, **kw)
            calls[name] += out is not None
            return out
        return wrapped

    monkeypatch.setattr(G, "linear_silu_mul", spy("silu_mul", G.linear_silu_mul))
    monkeypatch.setattr(G, "linear_rmsnorm", spy("norm", G.linear_rmsnorm))
    monkeypatch.setattr(G, "linear_rope_store", spy("rope", G.linear_rope_store))

    def run(epilogues: bool):
        monkeypatch.setattr(G, "DOT_EPILOGUES", epilogues)
        loaded = tiny_loaded(hf)
        drafter = ChainHeadDrafter(random_head(loaded.config, seed=3), k=2) if with_head \
            else None
        engine = LLMEngine(EngineConfig(
            model="tiny", device="cpu", tensor_core_rows="on",
            attention_backend="triton" if rope else None,
            cache=CacheConfig(kv_cache_tokens=1024),
            scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64),
            spec=SpecConfig(method="chain", num_draft_tokens=2) if with_head else SpecConfig()),
            loaded=loaded, drafter=drafter)
        gen = torch.Generator().manual_seed(5)
        prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (7, 9)]
        # with a head: one token, so the last target forward is the prefill (16 rows)
        outs = engine.generate(prompts, SamplingParams(max_tokens=1 if with_head else 8,
                                                       temperature=0, ignore_eos=True))
        streams = engine.target.capture.out[:16].clone() if with_head else None
        return [o.token_ids for o in outs], streams

    unfused, unfused_streams = run(False)
    assert calls == {"silu_mul": 0, "norm": 0, "rope": 0}
    fused, fused_streams = run(True)
    layers = hf.config.num_hidden_layers
    assert calls["norm"] >= layers - 1 and calls["norm"] % (layers - 1) == 0
    assert calls["silu_mul"] == 0 if split else calls["silu_mul"] >= layers
    assert calls["rope"] == (calls["silu_mul"] if rope else 0)
    assert fused == unfused
    if with_head:  # layers 0 (its norm fused into down) and 1 (the last: not fused)
        assert engine_layer_ids(hf) == (0, 1)
        assert fused_streams.abs().amin(0).gt(0).any()
        torch.testing.assert_close(fused_streams, unfused_streams, atol=1e-5, rtol=1e-5)


def engine_layer_ids(hf) -> tuple[int, ...]:
    from draftgraph.models.chain_head import default_layer_ids

    return tuple(default_layer_ids(hf.config.num_hidden_layers))
