"""TritonBackend runs the tiny model to the same logits as TorchBackend (interpreter on CPU)."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: run the kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton kernels need the triton package")

from draftgraph.attention.backend import ForwardBatch, Phase, TorchBackend  # noqa: E402
from draftgraph.attention.kv_pool import KVPool  # noqa: E402
from draftgraph.attention.metadata import MetadataBuffers  # noqa: E402
from draftgraph.attention.triton_backend import TritonBackend  # noqa: E402
from draftgraph.kernels._triton import compiled_for_cpu_missing  # noqa: E402
from draftgraph.kernels.metadata import _metadata_kernel  # noqa: E402
from draftgraph.models.config import ModelConfig  # noqa: E402
from draftgraph.models.llama import LlamaForCausalLM  # noqa: E402
from draftgraph.runtime.kv_cache import ReqToTokenPool  # noqa: E402

if compiled_for_cpu_missing(_metadata_kernel):
    pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set "
                "(set it in the environment to run them on CPU)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_BS, MAX_TOKENS, NUM_SLOTS = 4, 16, 64


def tiny_model(sliding_window):
    torch.manual_seed(0)
    layer_types = ["sliding_attention", "full_attention"] if sliding_window else []
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=64, sliding_window=sliding_window,
                      layer_types=layer_types)
    return cfg, LlamaForCausalLM(cfg).to(DEVICE).eval()


class Runner:
    """One backend with its own KV pool, request table and metadata buffers."""

    def __init__(self, cls, cfg, **kwargs):
        self.pool = KVPool(cfg.num_hidden_layers, NUM_SLOTS, cfg.num_key_value_heads,
                           cfg.head_dim, torch.float32, DEVICE)
        self.req_to_token = ReqToTokenPool(MAX_BS, 32, DEVICE).req_to_token
        self.backend = cls(self.pool, self.req_to_token, cfg.sliding_window,
                           cfg.head_dim**-0.5, **kwargs)
        self.meta = MetadataBuffers(MAX_BS, MAX_TOKENS, NUM_SLOTS, cfg.sliding_window, DEVICE)

    def step(self, model, phase, ids, req_pool_indices, seq_lens, extend_lens, out_cache_loc):
        fb = ForwardBatch(phase, ids, req_pool_indices, seq_lens, extend_lens, out_cache_loc,
                          self.meta)
        self.backend.build_metadata(fb)
        with torch.no_grad():
            return model.compute_logits(model(ids, fb, self.backend))


def steps():
    """Two requests (table rows 1, 2): prefill 5 + 7, two decode steps, one verify chunk."""
    gen = torch.Generator().manual_seed(3)
    lens = [0, 0]
    slot_base = [1, 32]  # request r's position p lives in slot slot_base[r] + p
    plan = [(Phase.EXTEND, [5, 7]), (Phase.DECODE, [1, 1]), (Phase.DECODE, [1, 1]),
            (Phase.VERIFY, [3, 2])]
    for phase, extend_lens in plan:
        out_cache_loc = [slot_base[r] + lens[r] + i for r in range(2)
                         for i in range(extend_lens[r])]
        lens = [n + e for n, e in zip(lens, extend_lens, strict=True)]
        ids = torch.randint(0, 64, (sum(extend_lens),), generator=gen)
        batch = (ids, [1, 2], lens, extend_lens, out_cache_loc)
        yield (phase, *(torch.as_tensor(x, device=DEVICE) for x in batch))


def no_host_reads(*_a, **_k):
    raise AssertionError("TritonBackend read a device value back to the host")


@pytest.mark.parametrize("sliding_window, extend_splits, invariant",
                         [(None, 1, False), (3, 1, False), (None, 3, False), (3, 3, False),
                          (None, 1, True)])
def test_triton_backend_logits_match_torch_backend(sliding_window, extend_splits, invariant,
                                                   monkeypatch):
    """extend_splits: the prefill's tiles in up to that many split-KV programs each (never
    under the batch-invariant plan, nor key tiles unmasked there: the GPU rounds the two
    loops apart)."""
    from draftgraph.kernels import attention as attn_kernels

    monkeypatch.setattr(attn_kernels, "EXTEND_MAX_SPLITS", extend_splits)
    cfg, model = tiny_model(sliding_window)
    torch_run = Runner(TorchBackend, cfg)
    triton_run = Runner(TritonBackend, cfg, max_bs=MAX_BS, num_q_heads=4, max_kv_splits=4,
                        invariant=invariant)
    launches = []
    extend = attn_kernels.extend_attention
    monkeypatch.setattr(attn_kernels, "extend_attention", lambda *a, **k: launches.append(
        (k["num_splits"], k["unmasked_first"])) or extend(*a, **k))
    ptrs = [t.data_ptr() for t in triton_run.meta.all_tensors()]
    backend = triton_run.backend
    scratch = [t.data_ptr() for t in (backend.mid_o, backend.mid_lse, backend.kv_counters)]
    for phase, *batch in steps():
        expect = torch_run.step(model, phase, *batch)
        with monkeypatch.context() as m:  # graph-capturable: no .item() / .tolist() inside
            m.setattr(torch.Tensor, "item", no_host_reads)
            m.setattr(torch.Tensor, "tolist", no_host_reads)
            got = triton_run.step(model, phase, *batch)
        torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4, msg=f"{phase}")
    assert torch.equal(torch_run.req_to_token, triton_run.req_to_token)
    for ours, theirs in zip(triton_run.pool.k_buffers + triton_run.pool.v_buffers,
                            torch_run.pool.k_buffers + torch_run.pool.v_buffers, strict=True):
        torch.testing.assert_close(ours, theirs)
    assert ptrs == [t.data_ptr() for t in triton_run.meta.all_tensors()]
    assert scratch == [t.data_ptr() for t in (backend.mid_o, backend.mid_lse, backend.kv_counters)]
    # split-KV decode leaves its arrival counters at zero, so a graph replay starts clean
    assert backend.kv_counters.dtype == torch.int32 and (backend.kv_counters == 0).all()
    # the prefill (and the verify chunk) ran in the splits asked for, extend's counters clean
    expect_plan = (1, False) if invariant else (extend_splits, True)
    assert launches and all(plan == expect_plan for plan in launches)
    if extend_splits > 1:
        assert not backend.extend_scratch["counters"].any()


def test_triton_backend_capabilities():
    assert TritonBackend.name == "triton"
    assert TritonBackend.in_graph_metadata and TritonBackend.draft_step_update


@pytest.mark.parametrize("exact", [False, True])
def test_verify_rows_take_their_row_count_plan_unless_exact(exact, monkeypatch):
    """Verify attention plans its splits by its rows (5 here: 3 + 2), not by its 2 requests
    as a decode row of the batch would, unless rows must be exact (then the decode row's
    plan, so a verify row is computed as that row); the output matches the torch backend
    either way. (Removing the rows' plan fails the inexact case.)"""
    from draftgraph.kernels import attention as attn_kernels

    cfg, model = tiny_model(None)
    torch_run = Runner(TorchBackend, cfg)
    triton_run = Runner(TritonBackend, cfg, max_bs=MAX_BS, num_q_heads=4, max_kv_splits=4)
    triton_run.backend.exact_rows = exact
    planned, plan = [], attn_kernels.decode_plan
    monkeypatch.setattr(attn_kernels, "decode_plan",
                        lambda bs, *a: planned.append(bs) or plan(bs, *a))
    for phase, *batch in steps():
        expect = torch_run.step(model, phase, *batch)
        planned.clear()
        got = triton_run.step(model, phase, *batch)
        torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4, msg=f"{phase}")
        if phase is Phase.VERIFY:  # the plan taken is the last asked for
            assert planned[-1] == (2 if exact else 5)
        elif phase is Phase.DECODE:
            assert set(planned) == {2}
    # (the rows' plan is taken only where the batch's splits rows, as here)
    assert plan(2, 4, 2, 16, 4)[0] > 1


@pytest.mark.parametrize("max_bs", [1, 4, 8])
def test_scratch_holds_the_largest_tree_at_every_request(max_bs):
    """A verify step of `max_bs` requests each bringing the largest tree (1 + TREE_MAX_NODES
    rows) fits the split-KV scratch under either plan (by requests, or by rows); the scratch
    once held 17 rows a request, and a GPU tree test of 8 requests x 33 rows failed on it."""
    from draftgraph.config import TREE_MAX_NODES
    from draftgraph.kernels import attention as attn

    cfg, _ = tiny_model(None)
    pool = KVPool(cfg.num_hidden_layers, NUM_SLOTS, cfg.num_key_value_heads, cfg.head_dim,
                  torch.float32, DEVICE)
    table = ReqToTokenPool(max_bs, 32, DEVICE).req_to_token
    hq, hkv, splits = 4, cfg.num_key_value_heads, 4
    backend = TritonBackend(pool, table, None, cfg.head_dim**-0.5, max_bs=max_bs,
                            num_q_heads=hq, max_kv_splits=splits)
    rows = max_bs * (1 + TREE_MAX_NODES)
    slots = max(attn.decode_plan(n, hq, hkv, cfg.head_dim, splits)[0] for n in (max_bs, rows))
    assert rows * slots * hq <= backend.mid_lse.numel()
    assert rows * slots * hq * cfg.head_dim <= backend.mid_o.numel()
    assert rows * hkv <= backend.kv_counters.numel()
