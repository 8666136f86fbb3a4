"""Page table from the request-to-token table, for attention kernels that read whole pages.

page_table[r, p] = req_to_token[req_pool_indices[r], p * page_size] // page_size
for p < ceil(seq_lens[r] / page_size). A request's positions fill its pages in order
(`PagedAllocator`), so the first slot of each page names the page. Entries past a row's live
pages are left as they are. Graph-safe: grid (bs,), loops bounded by each row's page count.
"""

import torch

from draftgraph.kernels._triton import tl, triton

BLOCK_PAGES = 128


@triton.jit
def _page_table_kernel(
    req_pool_indices, seq_lens, req_to_token, r2t_stride, page_table, pt_stride,
    PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    req = tl.load(req_pool_indices + r).to(tl.int64)
    num_pages = (tl.load(seq_lens + r).to(tl.int64) + PAGE_SIZE - 1) // PAGE_SIZE
    src = req_to_token + req * r2t_stride
    dst = page_table + r.to(tl.int64) * pt_stride
    for p0 in range(0, num_pages, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        mask = p < num_pages
        first_slot = tl.load(src + p * PAGE_SIZE, mask=mask)
        tl.store(dst + p, first_slot // PAGE_SIZE, mask=mask)


def build_page_table(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    page_size: int,
    page_table: torch.Tensor,
) -> None:
    """Write each request's page ids into the caller-owned page_table [max_bs, max_pages]."""
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    _page_table_kernel[(bs,)](
        req_pool_indices, seq_lens, req_to_token, req_to_token.stride(0), page_table,
        page_table.stride(0), PAGE_SIZE=page_size, BLOCK=BLOCK_PAGES, num_warps=4,
    )


def build_page_table_ref(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    page_size: int,
    page_table: torch.Tensor,
) -> None:
    """Torch twin of `build_page_table` (eager)."""
    for r, (req, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(),
                                           strict=True)):
        n = -(-seq_len // page_size)
        page_table[r, :n] = req_to_token[req, : n * page_size : page_size] // page_size
