#!/usr/bin/env bash
# Headless Chromium for tests/observability/test_dashboard_browser.py: Debian's chromium and its
# matching chromedriver, driven by selenium from PyPI (Selenium Manager never downloads a browser:
# the test passes both binaries' paths and SE_OFFLINE=true).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver
fi
python -m pip install -q "selenium>=4.20"
chromium --version 2>/dev/null
