# Sourced by the device scripts that need the real default model (train_head_gpu.sh,
# real_model_gpu.sh, deterministic_gpu.sh). A device call carries at most 64 MiB with the
# working tree (~52 MiB tracked since 2026-12-07: eighths of 11.7 MiB no longer fit), so the
# GGUF (94 MiB) travels in tenths over back-to-back calls to one warm machine (given back 30 s
# after a call: send the next at once):
#   once, here: G=<the GGUF>; for i in 1 .. 10: mkdir .modelj$i; `split -n 10 -d $G part`
#     puts part0(i-1) into .modelj$i; `sha256sum $G | cut -d' ' -f1 > .modelj10/sha256` (all
#     ignored);
#   calls 1-9: `SCRIPT stage N` with carry [".modeljN"]: gguf_stage N copies the part to D
#     (`SCRIPT stage 1 2 3` with carry [".modelj1", ".modelj2", ".modelj3"]: three at once,
#     where the tree is slim enough: benchmarks/slim_tree.sh);
#   the call that runs carries [".modelj10", ".whl_gguf"]: gguf_join puts the file together at
#     $M, checks its sha256 and installs the gguf wheel under /tmp/site.
# PARTS / NPARTS name another split (e.g. PARTS=.modeli NPARTS=8: eighths, for a smaller tree).
P=${PARTS:-.modelj} NP=${NPARTS:-10} WHL=${WHL:-.whl_gguf}
D=${GGUF_DIR:-/tmp/dg_model}
M=$D/smollm2.gguf

gguf_stage() {  # N...: each part's file copied to D
  mkdir -p "$D" || return 1
  for n in "$@"; do cp "$P$n"/part* "$D"/ || return 1; done
  ls "$D"
}

gguf_join() {
  if [ ! -f "$M" ]; then
    local staged
    staged=$(ls "$D"/part* 2>/dev/null | wc -l)
    if [ "$staged" -ne $((NP - 1)) ]; then
      echo "$staged of $((NP - 1)) parts staged: the machine was not the warm one"
      return 3
    fi
    cp "$P$NP"/part* "$D"/ && cat "$D"/part* > "$M"
  fi
  echo "$(cat "$P$NP"/sha256)  $M" | sha256sum -c - || return 4
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHL"/gguf-*.whl || return 1
}

# The opening of a script whose first argument may be `stage N`: that call copies part N and
# ends the script; any other call puts the file together (or ends the script with the
# reason).
gguf_stage_or_join() {
  if [ "${1:-}" = stage ]; then
    shift; gguf_stage "$@"; exit $?
  fi
  gguf_join || exit $?
}
