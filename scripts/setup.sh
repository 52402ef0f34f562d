#!/usr/bin/env bash
# Installs everything this project needs on a fresh Debian machine with Python >= 3.10:
# the mosquitto broker (used by the integration tests), a CPU build of torch, and this
# package with its test extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing mosquitto from Debian"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto >/dev/null
  else
    echo "setup: mosquitto not found; install it (apt-get install mosquitto) for its tests" >&2
  fi
fi

# The pin picks the local CPU wheel on our machines; the package itself accepts a range.
TORCH_PIN="${TORCH_PIN:-torch==2.13.0}"
echo "setup: installing $TORCH_PIN and the package"
python3 -m pip install -q "$TORCH_PIN"
python3 -m pip install -q -e ".[test]"
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
echo "setup: done"
