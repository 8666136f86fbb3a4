#!/usr/bin/env bash
# Here (CPU machine, repo root): fetch the server's wheels the GPU machine lacks into .whl/
# (git-ignored); then run benchmarks/serve_gpu_check.sh there with `carry: [".whl"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 \
  uvicorn==0.54.0 annotated-types==0.7.0 typing-inspection==0.4.2 annotated-doc==0.0.7 \
  opentelemetry-api==1.45.2 gguf==0.19.0 uvloop==0.23.0 httptools==0.9.0
# (fastapi >= 0.16x imports opentelemetry-api unconditionally; gguf is for the real model's
# GPU runs, benchmarks/real_model_gpu.sh; uvloop and httptools are the server extra's, which
# uvicorn uses when present)
ls .whl
