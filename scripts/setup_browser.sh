#!/usr/bin/env bash
# Idempotent: Debian's chromium (the browser tests never download a browser of their own) and Playwright
# for Python in .venv (its wheel ships the driver; `playwright install` is never run). Fast when done.
# Exit 0 when both are usable (chromium really starts under Playwright); non-zero, with the reason on
# stderr, otherwise. `make test` stops on that failure; INT8_ACCEL_SKIP_BROWSER=1 is the explicit opt-out
# (the Makefile then skips this script and tests/test_browser.py skips with that reason).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
log() { printf '[setup_browser] %s\n' "$*" >&2; }
trap 'log "failed (line $LINENO): the browser tests cannot run; fix this or set INT8_ACCEL_SKIP_BROWSER=1"' ERR

if ! command -v chromium >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    log "no apt-get: install Debian's chromium yourself"; exit 2
  fi
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
      log "not root and no password-less sudo: cannot apt-get install chromium"; exit 2
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  # Refresh the package lists only when apt does not know chromium yet.
  if ! apt-cache show chromium >/dev/null 2>&1; then
    log "apt-get update"
    $SUDO apt-get update -qq >/dev/null
  fi
  log "apt-get install chromium (about a minute)"
  if ! $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null; then
    log "apt-get update and retry"
    $SUDO apt-get update -qq >/dev/null
    $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
  fi
  $SUDO apt-get clean  # the downloaded .debs are not needed once installed
fi

if ! "$PY" -c "import playwright.sync_api" >/dev/null 2>&1; then
  log "pip install playwright into .venv"
  "$PY" -m pip install -q --no-cache-dir playwright
fi
CHROMIUM="$(command -v chromium)"
# Installed is not enough: chromium must start headless under Playwright's driver (a few seconds).
"$PY" - "$CHROMIUM" <<'PYEOF'
import sys
from playwright.sync_api import sync_playwright

with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=sys.argv[1], headless=True,
                                args=["--headless", "--no-sandbox", "--disable-gpu"])
    page = browser.new_page()
    page.set_content("<p id=ok>ok</p>")
    assert page.inner_text("#ok") == "ok"
    browser.close()
PYEOF
echo "$CHROMIUM"
