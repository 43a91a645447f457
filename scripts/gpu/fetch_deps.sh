#!/usr/bin/env bash
# Run HERE (a Debian machine with the package registry), before a GPU run: downloads the Debian
# packages the build needs beside CUDA into .gpudeps/ (git-ignored, ~20 MB; cpp-httplib and the
# headers its pkg-config file requires, for `k3 serve`). The GPU machine's image
# has nvcc, cmake and g++ but not these, and cannot reach a registry; scripts/gpu/run_all.sh unpacks
# them there with `dpkg -x` and builds against them (CMake's K3_DEPS_ROOT). Carry .gpudeps in the run.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpudeps
cd .gpudeps
apt-get download libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 libopenblas0-openmp \
  libopenblas-openmp-dev libopenblas-dev libgfortran5 libquadmath0 nlohmann-json3-dev libgtest-dev libcli11-dev \
  libcpp-httplib-dev libcpp-httplib0.11 libbrotli-dev libbrotli1 libssl-dev libssl3 zlib1g-dev \
  libpng-dev libpng16-16 libjpeg62-turbo-dev libjpeg62-turbo
ls -la
