#!/usr/bin/env bash
# One device call (carry [".whl", ".old"]): serving A/B of the engine's source trees, old
# (.old/src, from `git archive REV src | tar -x -C .old` here) and new (src), alternating,
# ARMS / MODELS / CONCURRENCY as serve_gpu_check.sh (default smollm2-135m at 64), then the
# offline run of the new tree.
export MODELS=${MODELS:-smollm2-135m} CONCURRENCY=${CONCURRENCY:-64} ARMS=${ARMS:-plain}
for tree in old new old new; do
  src=$PWD/src; [ $tree = old ] && src=$PWD/.old/src
  SRC=$src TAG=$tree NO_OFFLINE=1 bash benchmarks/serve_gpu_check.sh 2>&1 | grep -v "^serve-\|\.png$\|\.json$"
done
bash benchmarks/serve_gpu_check.sh 2>&1 | grep -E "tok/s|Output|offline|^c=|concurrency" | tail -6
