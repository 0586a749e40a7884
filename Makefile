PY := .venv/bin/python
SHELL := /bin/bash

.PHONY: setup setup-browser test test-kernels test-inprocess test-server demo bench lint checkpoint

setup:
	@bash scripts/setup.sh >/dev/null

setup-browser: setup
	@bash scripts/setup_browser.sh >/dev/null || echo "[setup] chromium could not be installed: browser tests will skip" >&2

checkpoint: setup
	@$(PY) -m scripts.make_checkpoint
	@$(PY) -m scripts.make_more_checkpoints

test: setup-browser
	@$(PY) -m pytest tests -q

test-kernels: setup
	@$(PY) -m pytest tests -q -m "not server and not browser" -k kernel

test-server: setup-browser
	@$(PY) -m pytest tests -q -m "server or browser"

demo: setup
	@$(PY) -m scripts.demo

bench: setup
	@for b in bench/bench_*.py; do $(PY) $$b || exit 1; done

lint: setup
	@$(PY) -m ruff check .
