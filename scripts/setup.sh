#!/usr/bin/env bash
# Installs everything this project needs on a fresh Debian machine with Python >= 3.10:
# mosquitto, openssl, iproute2 and chromium (used by the tests), a CPU build of torch,
# and this package with its test extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# mosquitto (a real broker for the tests), openssl (test certificates), iproute2 (`ip`, for
# the tests that emulate a LAN of gateway and devices in network namespaces) and chromium
# (Debian's build: the dashboard's browser test drives it headless).
missing=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || missing+=(mosquitto)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || missing+=(iproute2)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${missing[*]} from Debian"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "setup: ${missing[*]} not found; install them (apt-get install ${missing[*]}) for their tests" >&2
  fi
fi

# The pin picks the local CPU wheel on our machines; the package itself accepts a range.
TORCH_PIN="${TORCH_PIN:-torch==2.13.0}"
echo "setup: installing $TORCH_PIN and the package"
python3 -m pip install -q "$TORCH_PIN"
python3 -m pip install -q -e ".[test]"
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
echo "setup: done"
