#!/usr/bin/env bash
# Installs what the build needs, builds k3cpp, and runs the main job on its built-in default:
# `k3 generate` on the tiny K3 fixture model (greedy, 24 new tokens). Extra arguments go to k3 generate.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target k3
./build/k3 generate "$@"
