"""The attention-backend interface: capabilities that are read, a phase -> kernel table that
raises on a phase it does not handle, and the eager metadata advance (logged once)."""

from __future__ import annotations

import logging

import pytest
import torch

from draftgraph.attention.backend import ForwardBatch, Phase, TorchBackend
from draftgraph.attention.kv_pool import KVPool
from draftgraph.attention.metadata import MetadataBuffers
from draftgraph.attention.triton_backend import TritonBackend


def _backend(cls, window=None):
    pool = KVPool(1, 64, 2, 16, torch.float32, "cpu")
    r2t = torch.arange(4 * 40, dtype=torch.int64).view(4, 40) % 63 + 1
    kw = {"max_bs": 4, "num_q_heads": 4} if cls is TritonBackend else {}
    return cls(pool, r2t, window, 0.25, **kw), r2t


def _decode_batch(meta, seq_lens):
    bs = len(seq_lens)
    return ForwardBatch(Phase.DECODE, torch.zeros(bs, dtype=torch.int64),
                        torch.arange(1, bs + 1), torch.tensor(seq_lens),
                        torch.ones(bs, dtype=torch.int64), torch.arange(10, 10 + bs), meta)


@pytest.mark.parametrize("cls", [TorchBackend, TritonBackend])
def test_an_unhandled_phase_raises_naming_the_backend(cls):
    backend, _ = _backend(cls)
    # a draft block is a non-causal extend: every backend handles it with its extend kernel
    assert backend.kernel_for(Phase.DRAFT_BLOCK) == backend.kernel_for(Phase.EXTEND)
    backend.kernels = {p: k for p, k in cls.kernels.items() if p is not Phase.DRAFT_BLOCK}
    with pytest.raises(NotImplementedError, match=f"'{backend.name}'.*draft_block"):
        backend.kernel_for(Phase.DRAFT_BLOCK)
    assert backend.kernel_for(Phase.EXTEND) in {"sdpa", "extend"}
    # a draft-chain step is decode-shaped: it takes the decode kernel, never the extend one;
    # so do verify rows on Triton (each computed as the decode row at its position)
    assert backend.kernel_for(Phase.DRAFT_CHAIN) == backend.kernel_for(Phase.DECODE)
    assert backend.kernel_for(Phase.VERIFY) == backend.kernel_for(
        Phase.DECODE if cls is TritonBackend else Phase.EXTEND)


def test_capabilities_are_declared_per_backend():
    torch_b, _ = _backend(TorchBackend)
    triton_b, _ = _backend(TritonBackend)
    assert (torch_b.in_graph_metadata, torch_b.fused_kv_store) == (False, False)
    assert (triton_b.in_graph_metadata, triton_b.fused_kv_store) == (True, True)
    assert triton_b.kernel_for(Phase.DECODE) == "decode"
    assert not torch_b.draft_step_update and triton_b.draft_step_update


def test_eager_advance_rebuilds_the_next_steps_metadata_and_logs_once(caplog):
    backend, _ = _backend(TorchBackend, window=5)
    meta = MetadataBuffers(4, 8, 256, 5)
    fb = _decode_batch(meta, [7, 3, 12])
    backend.build_metadata(fb)
    with caplog.at_level(logging.INFO, logger="draftgraph.attention.backend"):
        for step in (1, 2):
            fb.seq_lens += 1
            fb.out_cache_loc += 3
            backend.advance_metadata(fb)
            ref = MetadataBuffers(4, 8, 256, 5)
            ref_fb = _decode_batch(ref, [7 + step, 3 + step, 12 + step])
            ref_fb.out_cache_loc.copy_(fb.out_cache_loc)
            backend.build_metadata(ref_fb)
            assert torch.equal(meta.positions[:3], ref.positions[:3])
            for kind, lists in meta.lists.items():
                n = int(ref.lists[kind].kv_indptr[3])
                assert torch.equal(lists.kv_indptr[:4], ref.lists[kind].kv_indptr[:4])
                assert torch.equal(lists.kv_indices[:n], ref.lists[kind].kv_indices[:n])
    lines = [r.getMessage() for r in caplog.records if "rebuilt eagerly" in r.getMessage()]
    assert len(lines) == 1 and "'torch'" in lines[0]
