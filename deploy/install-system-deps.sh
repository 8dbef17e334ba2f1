#!/usr/bin/env bash
# System packages the test suite needs: Chromium for the dashboard test (headless).
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium >/dev/null
