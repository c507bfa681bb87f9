#!/usr/bin/env bash
# Makes sure the Debian packages the tests drive are installed: chromium for the console's browser
# test (Playwright drives the system browser; it downloads none) and haproxy for the load balancer
# test (docker/haproxy.cfg in front of three proxies). Skips apt when both are there; fails when
# one cannot be installed, so the test command stops here instead of skipping a test.
#
#   ATDP_CHROMIUM   the browser's path (default /usr/bin/chromium)
#   ATDP_HAPROXY    haproxy's path (default /usr/sbin/haproxy)
set -euo pipefail
browser="${ATDP_CHROMIUM:-/usr/bin/chromium}"
haproxy="${ATDP_HAPROXY:-/usr/sbin/haproxy}"
missing=()
[[ -x "$browser" ]] || missing+=(chromium)
[[ -x "$haproxy" ]] || missing+=(haproxy)
if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi
echo "[system packages] installing Debian's ${missing[*]}" >&2
sudo=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "[system packages] not root and no sudo: install ${missing[*]} by hand" >&2; exit 1; }
  sudo=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -q >&2
"${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
for path in "$browser" "$haproxy"; do
  [[ -x "$path" ]] || { echo "[system packages] installed, but $path is missing" >&2; exit 1; }
done
