#!/usr/bin/env bash
# Best effort: MLX's Linux CPU wheel bundles a slow reference BLAS; the engine preloads
# OpenBLAS when it is installed (engine_service/blas.py). Never fails the build.
[ "$(uname -s)" = Linux ] || exit 0
if ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0'; then exit 0; fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing OpenBLAS (libopenblas0-pthread) for fast CPU matmuls"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1; } ||
    echo "note: could not install OpenBLAS; MLX falls back to its slow bundled BLAS"
else
  echo "note: OpenBLAS not found (install libopenblas0-pthread); MLX uses its slow bundled BLAS"
fi
exit 0
