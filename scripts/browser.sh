#!/usr/bin/env bash
# Makes sure Debian's chromium is installed for the console's browser test (Playwright drives the
# system browser; it downloads none). Skips apt when the browser is there; fails when it cannot be
# installed, so the test command stops here instead of skipping the browser test.
#
#   ATDP_CHROMIUM   the browser's path (default /usr/bin/chromium)
set -euo pipefail
browser="${ATDP_CHROMIUM:-/usr/bin/chromium}"
if [[ -x "$browser" ]]; then
  exit 0
fi
echo "[browser] $browser missing: installing Debian's chromium" >&2
sudo=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "[browser] not root and no sudo: install chromium by hand" >&2; exit 1; }
  sudo=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -q >&2
"${sudo[@]}" apt-get install -y -q --no-install-recommends chromium >&2
[[ -x "$browser" ]] || { echo "[browser] chromium installed but $browser is missing" >&2; exit 1; }
