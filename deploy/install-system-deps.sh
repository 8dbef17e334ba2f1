#!/usr/bin/env bash
# System packages the test suite needs: Chromium for the dashboard test (headless);
# iptables for the lossy link of the multi-host tests and the chaos benchmark.
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium iptables >/dev/null
