"""Store the new tokens' K and V into the per-layer KV pool at their write slots."""

import torch

from draftgraph.kernels._triton import next_pow2, pdl_kwargs, pdl_wait, tl, triton


@triton.jit
def _store_kv_kernel(
    k, v, k_cache, v_cache, out_cache_loc,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    # One program per token: all KV heads of K and V.
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(out_cache_loc + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    kt = tl.load(k + t * stride_kt + h * stride_kh + d, mask=mask)
    vt = tl.load(v + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache + slot * stride_kcs + h * stride_kch + d,
             kt.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + slot * stride_vcs + h * stride_vch + d,
             vt.to(v_cache.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """k, v [T, Hkv, D] (last dim contiguous) -> k_cache / v_cache [num_slots, Hkv, D]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1, "store_kv needs a contiguous head_dim"
    assert k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, out_cache_loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4, **pdl_kwargs(k),
    )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """Torch twin of `store_kv`."""
    k_cache[out_cache_loc] = k.to(k_cache.dtype)
    v_cache[out_cache_loc] = v.to(v_cache.dtype)
