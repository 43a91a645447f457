#!/usr/bin/env bash
# Installs the Debian packages k3cpp builds against. Idempotent: a package already present is left alone.
set -euo pipefail
PKGS=(cmake g++ make libopenblas-openmp-dev nlohmann-json3-dev libcli11-dev libgtest-dev libbenchmark-dev libomp-dev libpcre2-dev pkg-config)
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
