"""A train-drafter run's regenerated sequences (RUN/sequences.json) in a compact form that fits
the GPU machine's 16 MiB-per-file return path, and back.

    python benchmarks/pack_sequences.py pack RUN/sequences.json DIR    # DIR/seqs.npz[.partNN]
    python benchmarks/pack_sequences.py unpack DIR RUN/sequences.json
    python benchmarks/pack_sequences.py merge A/sequences.json B/sequences.json RUN/sequences.json
    python benchmarks/pack_sequences.py prompts DIR[,DIR...] PROMPTS.json.gz [--every N]

`pack` writes the token ids as uint16 (every vocabulary this project trains on has fewer than
65536 entries), their lengths and prompt lengths, compressed, cut into pieces of at most
--piece-mib MiB; `unpack` joins them, rebuilds sequences.json and checks its sha256 (the one
train-drafter recorded) before writing it; `merge` concatenates two runs' sequences (the same
model and response length) into one file with its own sha256, the parts' hashes kept in
`merged_from`; `prompts` writes the prompts of packed sequences (every Nth of each DIR, in
turn) as the JSON list of token-id lists `train-drafter --data` reads, to regenerate their
responses another way (e.g. sampled: `--temperature`).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import os
import sys

import numpy as np


def _sha256(ids: list[list[int]], prompt_lens: list[int]) -> str:
    # the hash train/cli.py records: JSON of [[ids, prompt_len], ...]
    blob = json.dumps([[s, p] for s, p in zip(ids, prompt_lens, strict=True)]).encode()
    return hashlib.sha256(blob).hexdigest()


def pack(src: str, out_dir: str, piece_mib: float) -> int:
    with open(src) as f:
        saved = json.load(f)
    seqs = saved["sequences"]
    tokens = np.fromiter((t for s in seqs for t in s["ids"]), dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 1 << 16):
        raise ValueError("token ids outside uint16: this packing does not fit the vocabulary")
    meta = {k: v for k, v in saved.items() if k != "sequences"}
    buf = io.BytesIO()
    np.savez_compressed(buf, tokens=tokens.astype(np.uint16),
                        lengths=np.array([len(s["ids"]) for s in seqs], dtype=np.int32),
                        prompt_lens=np.array([s["prompt_len"] for s in seqs], dtype=np.int32),
                        meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    data = buf.getvalue()
    os.makedirs(out_dir, exist_ok=True)
    piece = int(piece_mib * (1 << 20))
    parts = [data[i : i + piece] for i in range(0, len(data), piece)]
    for i, p in enumerate(parts):
        name = "seqs.npz" if len(parts) == 1 else f"seqs.npz.part{i:02d}"
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(p)
    print(json.dumps({"sequences": len(seqs), "tokens": int(tokens.size),
                      "response_tokens": int(sum(len(s["ids"]) - s["prompt_len"] for s in seqs)),
                      "sha256": meta.get("sha256"), "packed_bytes": len(data),
                      "packed_sha256": hashlib.sha256(data).hexdigest(), "pieces": len(parts)}))
    return 0


def _read(src_dir: str) -> tuple[dict, list[list[int]], list[int], str] | None:
    """A packed folder's metadata, token ids, prompt lengths and sha256 (None, said on
    stderr, when they do not hash to what the run recorded)."""
    names = sorted(glob.glob(os.path.join(src_dir, "seqs.npz.part*"))) or \
        [os.path.join(src_dir, "seqs.npz")]
    data = b"".join(open(n, "rb").read() for n in names)
    z = np.load(io.BytesIO(data))
    meta = json.loads(z["meta"].tobytes().decode())
    flat = z["tokens"].astype(np.int64).tolist()
    ids, at = [], 0
    for n in z["lengths"].tolist():
        ids.append(flat[at : at + n])
        at += n
    prompt_lens = z["prompt_lens"].tolist()
    sha = _sha256(ids, prompt_lens)
    if meta.get("sha256") not in (None, sha):
        print(f"error: the unpacked sequences hash to {sha}, the run recorded "
              f"{meta['sha256']}", file=sys.stderr)
        return None
    return meta, ids, prompt_lens, sha


def unpack(src_dir: str, dst: str) -> int:
    read = _read(src_dir)
    if read is None:
        return 1
    meta, ids, prompt_lens, sha = read
    at = sum(map(len, ids))
    os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
    with open(dst, "w") as f:
        json.dump({**meta, "sha256": sha,
                   "sequences": [{"ids": s, "prompt_len": p}
                                 for s, p in zip(ids, prompt_lens, strict=True)]}, f)
    print(json.dumps({"sequences": len(ids), "tokens": at, "sha256": sha}))
    return 0


def merge(a: str, b: str, dst: str) -> int:
    runs = []
    for src in (a, b):
        with open(src) as f:
            runs.append(json.load(f))
    for key in ("model", "max_new_tokens"):
        if runs[0].get(key) != runs[1].get(key):
            print(f"error: {a} and {b} differ in {key}: {runs[0].get(key)!r} against "
                  f"{runs[1].get(key)!r}", file=sys.stderr)
            return 1
    seqs = runs[0]["sequences"] + runs[1]["sequences"]
    sha = _sha256([s["ids"] for s in seqs], [s["prompt_len"] for s in seqs])
    os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
    with open(dst, "w") as f:
        json.dump({"sha256": sha, "model": runs[0].get("model"),
                   "max_new_tokens": runs[0].get("max_new_tokens"),
                   "merged_from": [r.get("sha256") for r in runs], "sequences": seqs}, f)
    print(json.dumps({"sequences": len(seqs), "sha256": sha,
                      "merged_from": [r.get("sha256") for r in runs]}))
    return 0


def prompts(src_dirs: str, dst: str, every: int) -> int:
    import gzip

    out = []
    for src in src_dirs.split(","):
        read = _read(src)
        if read is None:
            return 1
        _, ids, prompt_lens, _ = read
        out += [s[:p] for s, p in zip(ids[::every], prompt_lens[::every], strict=True)]
    with gzip.open(dst, "wt") as f:
        json.dump(out, f)
    print(json.dumps({"prompts": len(out), "every": every}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("src")
    p.add_argument("out_dir")
    p.add_argument("--piece-mib", type=float, default=15.0)
    u = sub.add_parser("unpack")
    u.add_argument("src_dir")
    u.add_argument("dst")
    m = sub.add_parser("merge")
    m.add_argument("a")
    m.add_argument("b")
    m.add_argument("dst")
    q = sub.add_parser("prompts")
    q.add_argument("src_dirs", help="packed sequences' folders, joined by commas")
    q.add_argument("dst")
    q.add_argument("--every", type=int, default=1, help="every Nth sequence's prompt (N >= 1)")
    a = ap.parse_args()
    if a.cmd == "prompts":
        if a.every < 1:
            ap.error(f"--every must be >= 1, got {a.every}")
        return prompts(a.src_dirs, a.dst, a.every)
    if a.cmd == "merge":
        return merge(a.a, a.b, a.dst)
    return pack(a.src, a.out_dir, a.piece_mib) if a.cmd == "pack" else unpack(a.src_dir, a.dst)


if __name__ == "__main__":
    sys.exit(main())
