#!/usr/bin/env bash
# The Debian packages the test suite needs beyond Python: chromium, for the report's headless
# browser test (tests/coordinator/test_report.py; it skips, saying so, where chromium is missing).
# Installed with apt-get when missing, as root (CI runs as root); nothing done when present, so a
# machine that has it pays nothing. --no-install-recommends keeps it to the browser itself.
#
#   bash deploy/ci/system_packages.sh
set -euo pipefail
missing=()
command -v chromium >/dev/null || missing+=(chromium)
if ((${#missing[@]})); then
    echo "[system packages] installing ${missing[*]}" >&2
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi
