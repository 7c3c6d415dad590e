#!/usr/bin/env bash
# promtool for tests/observability/test_deploy_files.py: it checks deploy/prometheus/*.yml and
# parses every PromQL query of the Grafana dashboard. Only the promtool binary is taken out of
# Debian's prometheus package (no service installed, nothing started).
set -euo pipefail
if command -v promtool >/dev/null; then
  promtool --version | head -n 1
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"  # apt downloads as the _apt user
$SUDO apt-get update -q
(cd "$work" && apt-get download prometheus)
dpkg-deb -x "$work"/prometheus_*.deb "$work/root"
$SUDO install -m 0755 "$work/root/usr/bin/promtool" /usr/local/bin/promtool
promtool --version | head -n 1
