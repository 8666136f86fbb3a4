"""Compile the step's Triton kernels for an H100 / H200 (sm_90) on a machine without a GPU:
Triton's own front end, its MLIR passes and the ptxas its wheel ships, down to a cubin, with
the argument types and constexprs the launchers pass (the default model's shapes). What a
CPU session can say about a kernel the interpreter ran but no GPU compiled; not a substitute
for a GPU run (this Triton may be newer than the GPU machine's).

    python benchmarks/compile_sm90.py --out benchmarks/results/compile_sm90.json

Per kernel configuration: compiled or the error, registers and spills.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter

import triton  # noqa: E402
from _meta import run_header  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from draftgraph.config import TreeShape  # noqa: E402
from draftgraph.kernels import argmax as A  # noqa: E402
from draftgraph.kernels import elementwise as E  # noqa: E402
from draftgraph.kernels import matmul as MM  # noqa: E402
from draftgraph.kernels import metadata as M  # noqa: E402
from draftgraph.kernels import ngram as N  # noqa: E402
from draftgraph.kernels import tokens as K  # noqa: E402
from draftgraph.kernels import tree as T  # noqa: E402

I64 = "*i64"


def kernel_configs() -> list[tuple[str, object, dict, dict]]:
    """(label, kernel, argument types (pointers and scalars; default *i64), constexprs)."""
    f32 = "*fp32"
    c = []
    for lt in ("*fp32", "*bf16"):  # logits as a verify (fp32) or a draft head (bf16) gives them
        c.append((f"argmax chunk {lt}", A._argmax_lse_chunk_kernel,
                  {"logits": lt, "part_max": f32, "part_idx": "*i32", "part_sum": f32,
                   "vocab": "i32", "stride_row": "i32", "num_chunks": "i32"},
                  {"CHUNK": 1024, "PDL": True}))
        c.append((f"top-W chunk {lt}", T._top_chunk_kernel,
                  {"logits": lt, "part_val": f32, "part_idx": "*i32", "part_max": f32,
                   "part_sum": f32, "vocab": "i32", "stride_row": "i32", "num_chunks": "i32"},
                  {"W": 4, "CHUNK": 1024, "PDL": True}))
    c.append(("argmax combine", A._argmax_lse_combine_kernel,
              {"part_max": f32, "part_idx": "*i32", "part_sum": f32, "lse": f32,
               "top_logprob": f32, "vocab": "i32", "num_chunks": "i32"},
              {"HAS_TOP_LP": True, "BLOCK_C": 64, "PDL": True}))
    for w in (4, 12):  # 4x5:16's beam and 12x5:63's (16 chunks of the head's 16k tokens)
        c.append((f"top-W combine W={w}", T._top_combine_kernel,
                  {"part_val": f32, "part_idx": "*i32", "part_max": f32, "part_sum": f32,
                   "top_lp": f32, "vocab": "i32", "num_chunks": "i32"},
                  {"W": w, "BLOCK_C": 16, "BLOCK_CW": 1 << (16 * w - 1).bit_length(),
                   "PDL": True}))
    c.append(("top-W chunk W=12 *bf16", T._top_chunk_kernel,
              {"logits": "*bf16", "part_val": f32, "part_idx": "*i32", "part_max": f32,
               "part_sum": f32, "vocab": "i32", "stride_row": "i32", "num_chunks": "i32"},
              {"W": 12, "CHUNK": 1024, "PDL": True}))
    for first, stage in ((True, True), (False, True), (False, False)):
        c.append((f"tree grow first={first} stage={stage}", T._tree_grow_kernel,
                  {"top_lp": f32, "stream": "*bf16", "node_score": f32, "t_feat": "*bf16",
                   **{n: "i32" for n in ("step", "lo", "total", "hidden", "stride_stream",
                                         "stride_feat", "stride_rows", "stride_res0",
                                         "stride_res1")}},
                  {"W": 4, "R": 1 if first else 4, "D": 5, "C_P": 4 if first else 16,
                   "W_P": 4, "D_P": 8, "BLOCK_H": 256, "FIRST": first, "STAGE": stage,
                   "HAS_VOCAB": True, "PDL": True}))
    p2 = triton.next_power_of_2
    # the old defaults, the largest, with n-gram branches (the default: 8x5:27+g16)
    for name in ("4x5:16", "8x5:32", "12x5:63", "8x5:27+g5", "8x5:27+g16"):
        shape = TreeShape.parse(name)
        w, d, k = shape.width, shape.depth, shape.verified
        c.append((f"tree pick {name}", T._tree_pick_kernel,
                  {"node_score": f32, "total": "i32", "stride_o": "i32", "n_pick": "i32"},
                  {"BRANCH": shape.ngram, "T_P": p2(shape.total),
                   "PDL": True}))
        c.append((f"tree pack {name}", T._tree_pack_kernel,
                  {"live": "*i8", "stride_res0": "i32", "stride_res1": "i32",
                   "stride_rows": "i32"},
                  {"K": k, "D": d, "T_P": p2(k + 1), "D_P": p2(d), "PDL": True}))
        c.append((f"tree accept {name}", T._tree_accept_kernel,
                  {"logits": f32, "lse": f32, "live": "*i8", "out_logprobs": f32,
                   **{n: "i32" for n in ("stride_logits", "stride_res0", "stride_res1",
                                         "stride_r2t", "stride_table", "stride_tok",
                                         "stride_lp", "stride_copy")}},
                  {"T": k + 1, "D": d, "T_P": p2(k + 1), "D_P": p2(d), "PDL": True}))
        if w > 4:  # a beam step of this width (width 4's: above)
            c.append((f"tree grow {name}", T._tree_grow_kernel,
                      {"top_lp": f32, "stream": "*bf16", "node_score": f32, "t_feat": "*bf16",
                       **{n: "i32" for n in ("step", "lo", "total", "hidden", "stride_stream",
                                             "stride_feat", "stride_rows", "stride_res0",
                                             "stride_res1")}},
                      {"W": w, "R": w, "D": d, "C_P": p2(w * w), "W_P": p2(w), "D_P": p2(d),
                       "BLOCK_H": 256, "FIRST": False, "STAGE": True, "HAS_VOCAB": True,
                       "PDL": True}))
    for k, block in ((4, 256), (16, 256), (4, 2)):
        c.append((f"chain pack k={k} bs<={block}", K._pack_chain_kernel,
                  {"bs": "i32", "stride_drafts": "i32", "stride_slots": "i32",
                   "stride_table": "i32"},
                  {"K": k, "BLOCK": block, "BLOCK_T": triton.next_power_of_2(k + 1),
                   "PDL": True}))
    for path in (False, True):
        c.append((f"catch-up staging path={path}", K._stage_catch_up_kernel,
                  {"bs": "i32", "total": "i32", "stride_tok": "i32", "stride_slots": "i32",
                   "stride_path": "i32"},
                  {"M": 5 if path else 4, "HAS_PATH": path, "BLOCK": 256, "BLOCK_M": 8,
                   "PDL": True}))
    c.append(("greedy emit k=4", A._greedy_emit_kernel,
              {"logits": f32, "lse": f32, "out_logprobs": f32,
               **{n: "i32" for n in ("stride_logits", "stride_drafts", "stride_tok",
                                     "stride_lp")}},
              {"K": 4, "BLOCK_T": 8, "PDL": True}))
    c.append(("rms norm (a half of a wider buffer)", E._rms_norm_kernel,
              {"x": "*bf16", "weight": "*bf16", "residual": "*bf16", "out": "*bf16",
               "residual_out": "*bf16", "n_cols": "i32", "eps": "fp32", "stride_x": "i32",
               "stride_r": "i32", "stride_o": "i32", "stride_ro": "i32"},
              {"HAS_RESIDUAL": False, "BLOCK": 1024, "PDL": True}))
    for mapped, stage in ((True, True), (False, False)):
        c.append((f"draft take vocab={mapped} stage={stage}", K._draft_take_kernel,
                  {"part_max": f32, "part_idx": "*i32",
                   "vocab_map": "*i64" if mapped else "*i32",
                   **{n: "i32" for n in ("col", "vocab", "num_chunks", "stride_drafts",
                                         "stride_reserved")}},
                  {"HAS_VOCAB": mapped, "STAGE": stage, "BLOCK_C": 16, "PDL": True}))
    for slots, lists, sliding, paths, new in ((True, True, False, False, True),
                                              (True, False, False, False, False),
                                              (False, True, True, False, True),
                                              (False, True, False, True, False)):
        c.append((f"metadata slots={slots} lists={lists} sliding={sliding} paths={paths}",
                  M._metadata_kernel,
                  {n: "i32" for n in ("r2t_stride", "capacity", "window", "path_stride")},
                  {"SLOTS": slots, "LISTS": lists, "SLIDING": sliding, "PATHS": paths,
                   "NEW": new, "SCAN_BLOCK": M.SCAN_BLOCK, "BLOCK": M.COPY_BLOCK}))
    bf16 = "*bf16"
    # SmolLM2's qkv and down configs (DOT_TUNED), with PDL; gate_up's with SwiGLU
    for split, silu_mul in ((1, False), (4, False), (1, True)):
        c.append((f"tensor-core rows split={split} silu_mul={silu_mul}", MM._dot_kernel,
                  {"x": bf16, "w": bf16, "y": bf16, "part": f32, "bias": bf16, "res": bf16,
                   **{n: "i32" for n in ("M", "N", "K", "K_SPLIT", "stride_xm", "stride_wn",
                                         "stride_ym", "stride_rm")}},
                  {"HAS_BIAS": False, "HAS_RES": False, "SPLIT": split, "EVEN_K": True,
                   "SILU_MUL": silu_mul, "PRECISION": "tf32", "BLOCK_M": 64, "BLOCK_N": 32,
                   "BLOCK_K": 64, "PDL": True}))
    c.append(("n-gram drafts (the tree's branch)", N._ngram_kernel,
              {n: "i32" for n in ("table_stride", "stride_d", "k")},
              {"MIN_N": 1, "MAX_N": 4, "N_BLOCK": 8, "K_BLOCK": 8, "BLOCK": 1024}))
    c.append(("tensor-core rows qkv + RoPE + KV store", MM._dot_rope_kernel,
              {"x": bf16, "w": bf16, "bias": bf16, "q_out": bf16, "k_cache": bf16,
               "v_cache": bf16, "out_cache_loc": "*i64", "positions": "*i64",
               "cos_sin_cache": f32,
               **{n: "i32" for n in ("M", "K", "stride_xm", "stride_wn", "stride_qot",
                                     "stride_qoh", "stride_kcs", "stride_kch", "stride_vcs",
                                     "stride_vch", "stride_cs")}},
              {"NUM_Q_HEADS": 9, "NUM_KV_HEADS": 3, "HAS_BIAS": False, "EVEN_K": True,
               "PRECISION": "tf32", "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 64, "PDL": True}))
    c.append(("tensor-core rows combine + next norm", MM._combine_rmsnorm_kernel,
              {"part": f32, "res": bf16, "res_out": bf16, "out": bf16, "norm_weight": bf16,
               "eps": "fp32",
               **{n: "i32" for n in ("M", "N", "stride_rm", "stride_rom", "stride_om")}},
              {"SPLIT": 4, "BLOCK": 1024, "PDL": True}))
    c.append(("tensor-core rows combine", MM._combine_kernel,
              {"part": f32, "y": bf16, "bias": bf16, "res": bf16,
               **{n: "i32" for n in ("M", "N", "stride_ym", "stride_rm")}},
              {"HAS_BIAS": False, "HAS_RES": False, "SPLIT": 4, "BLOCK": 1024, "PDL": True}))
    # extend attention (prefill), unsplit and in split-KV (kernels/attention.py), SmolLM2's
    # heads (9 / 3 x 64: 21 tokens a 64-row tile) at the plan before stop 56 (64 keys,
    # every tile masked) and the plan's (128 keys, unmasked first; a window, a draft block),
    # and the 8B's (32 / 8 x 128: 64 keys); triton.compile's default 3 stages, as the plan
    from draftgraph.kernels import attention as AT

    smollm2 = {"GROUP": 3, "HEAD_DIM": 64, "TOKENS_PER_TILE": 21, "BLOCK_D": 64,
               "BLOCK_N": AT.extend_block_n(64)}
    variants = [
        ("splits=1 masked 64 keys", dict(smollm2, BLOCK_N=64, UNMASKED_FIRST=False)),
        ("splits=1", dict(smollm2)),
        ("splits=4", dict(smollm2, NUM_SPLITS=4)),
        ("window", dict(smollm2, SLIDING=True)),
        ("draft block", dict(smollm2, NONCAUSAL=True)),
        ("8B heads", {"GROUP": 4, "HEAD_DIM": 128, "TOKENS_PER_TILE": 16, "BLOCK_D": 128,
                      "BLOCK_N": AT.extend_block_n(128)}),
    ]
    for label, consts in variants:
        c.append((f"extend attention {label}", AT._extend_kernel,
                  {"q": bf16, "k_cache": bf16, "v_cache": bf16, "o": bf16, "mid_o": f32,
                   "mid_lse": f32, "counters": "*i32", "sm_scale_log2": "fp32",
                   **{n: "i32" for n in ("bs", "window", "max_tiles", "split_tiles",
                                         "stride_qt", "stride_qh", "stride_ks", "stride_kh",
                                         "stride_vs", "stride_vh", "stride_ot", "stride_oh")}},
                  {"BLOCK_M": 64, "SCAN_BLOCK": 128, "SLIDING": False, "DOT_PRECISION": "tf32",
                   "NONCAUSAL": False, "NUM_SPLITS": 1, "UNMASKED_FIRST": True, "PDL": True,
                   **consts}))
    return c


def compile_one(kernel, types: dict, consts: dict, arch: int) -> dict:
    names = kernel.arg_names
    sig = {n: ("constexpr" if n in consts else types.get(n, I64)) for n in names}
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={(names.index(n),): v for n, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    meta = getattr(k, "metadata", None)
    return {"ok": True, "cubin_bytes": len(k.asm.get("cubin", b"")),
            "shared": getattr(meta, "shared", None)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = {"benchmark": "compile_sm90", **run_header("cpu"), "triton": triton.__version__,
           "arch": a.arch, "kernels": {}}
    failed = 0
    for label, kernel, types, consts in kernel_configs():
        try:
            r = compile_one(kernel, types, consts, a.arch)
        except Exception as e:  # report every kernel, then fail
            r = {"ok": False, "error": f"{type(e).__name__}: {e}"[:4000],
                 "trace": traceback.format_exc()[-2000:]}
            failed += 1
        out["kernels"][label] = r
        print(("ok   " if r["ok"] else "FAIL ") + label +
              ("" if r["ok"] else "\n" + r["error"]), flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
