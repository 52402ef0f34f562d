#!/usr/bin/env bash
# Sets this project up for development on a Debian (or Raspberry Pi OS) machine with
# Python >= 3.10: mosquitto, openssl, iproute2 and chromium (used by the tests), then, in a
# virtual environment, a CPU build of torch and this package with its test extras.
#
# The environment: the active virtual environment when there is one (`.venv` here becomes a
# link to it), otherwise `.venv` here, made on first run. pip never touches the system
# Python, which Debian 12 and Raspberry Pi OS refuse anyway (PEP 668). Afterwards
# `.venv/bin/coordinator`, `.venv/bin/edge-agent` and `.venv/bin/python` are the programs;
# `source .venv/bin/activate` puts them on PATH. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# mosquitto (a real broker for the tests), openssl (test certificates), iproute2 (`ip`, for
# the tests that emulate a LAN of gateway and devices in network namespaces), chromium
# (Debian's build: the dashboard's browser test drives it headless) and python3-venv (Debian
# ships venv without ensurepip otherwise).
missing=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || missing+=(mosquitto)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || missing+=(iproute2)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if [ -z "${VIRTUAL_ENV:-}" ] && [ ! -x .venv/bin/python ] \
  && ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
  missing+=(python3-venv)
fi
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${missing[*]} from Debian"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "setup: ${missing[*]} not found; install them (apt-get install ${missing[*]})" >&2
  fi
fi

if [ -n "${VIRTUAL_ENV:-}" ]; then
  venv="$VIRTUAL_ENV"
  if [ -e .venv ] && [ "$(readlink -f .venv)" != "$(readlink -f "$venv")" ]; then
    echo "setup: $venv is active but .venv here is another environment: deactivate to use" \
      ".venv, or remove .venv to use $venv" >&2
    exit 1
  fi
  [ -e .venv ] || ln -s "$venv" .venv
  echo "setup: installing into the active virtual environment $venv"
else
  venv="$PWD/.venv"
  if [ ! -x "$venv/bin/python" ]; then
    echo "setup: making the virtual environment .venv"
    python3 -m venv "$venv"
  fi
fi
python="$venv/bin/python"

# The pin picks the local CPU wheel on our machines; the package itself accepts a range.
TORCH_PIN="${TORCH_PIN:-torch==2.13.0}"
echo "setup: installing $TORCH_PIN and the package with its test extras"
"$python" -m pip install -q "$TORCH_PIN"
"$python" -m pip install -q -e ".[test]"
echo "setup: done; the programs are in .venv/bin (source .venv/bin/activate puts them on PATH)"
