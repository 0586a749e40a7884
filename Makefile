PY ?= $(CURDIR)/.venv/bin/python
SHELL := /bin/bash
export PY
# The browser tests (tests/test_browser.py) are part of `make test`: when chromium or Playwright cannot be set
# up, `make test` and `make test-server` stop with the reason instead of running a suite that skips them.
# INT8_ACCEL_SKIP_BROWSER=1 is the one explicit opt-out: the set-up is not attempted and those tests skip
# with that reason in pytest's summary.

.PHONY: setup setup-browser test test-kernels test-floor test-torch211 test-inprocess test-server test-gpu gpu-bundle gpu-run demo bench lint checkpoint train-models

drop_leg_venv = if [ "$${INT8_ACCEL_DROP_LEG_VENVS:-}" = 1 ]; then rm -rf $(CURDIR)/$(1); fi

# The kernel tier (tests/support/tiers.py): tests of kernels/ alone, which run without importing ComfyUI.
KERNEL_TESTS = tests/test_kernels*.py

setup:
	@bash scripts/setup.sh >/dev/null

setup-browser: setup
	@if [ "$${INT8_ACCEL_SKIP_BROWSER:-}" = 1 ]; then \
	  echo "[setup] INT8_ACCEL_SKIP_BROWSER=1: browser set-up not attempted, the browser tests will skip" >&2; \
	elif ! bash scripts/setup_browser.sh >/dev/null; then \
	  echo "[setup] chromium/Playwright set-up failed (reason above): the browser tests cannot run." >&2; \
	  echo "[setup] Fix it, or run with INT8_ACCEL_SKIP_BROWSER=1 to skip the browser tests explicitly." >&2; \
	  exit 1; \
	fi

checkpoint: setup
	@$(PY) -m harness.make_checkpoint
	@$(PY) -m harness.make_more_checkpoints

# The two older-PyTorch legs run first: with INT8_ACCEL_DROP_LEG_VENVS=1 (set by .ci/run on its throwaway clone)
# each removes its environment when done, so their 11 GB and the main suite's random checkpoints (about 9 GB)
# are never on disk together.
test: setup-browser
	@$(MAKE) --no-print-directory test-floor
	@$(MAKE) --no-print-directory test-torch211
	@$(PY) -m pytest tests -q

test-kernels: setup
	@$(PY) -m pytest $(KERNEL_TESTS) -q

# The kernel tier, the INT8 layers on the CUDA path and the INT8 -> DeepCache -> Compile smoke on the oldest
# PyTorch pyproject.toml declares (.venv-floor, built by scripts/setup_floor.sh, which prints that version).
test-floor: setup
	@floor="$$(bash scripts/setup_floor.sh)" && \
	  INT8_ACCEL_EXPECT_TORCH="$$floor" $(CURDIR)/.venv-floor/bin/python -m pytest -q \
	    $(KERNEL_TESTS) tests/test_int8_layers_gpu_path.py tests/test_torch_floor.py; \
	  status=$$?; $(call drop_leg_venv,.venv-floor); exit $$status

# The kernel tier, the Compile Model tests below and the same smoke on PyTorch 2.11 with Triton 3.6
# (.venv-torch211, built by scripts/setup_torch211.sh, which prints that version): its torch.compile takes no
# recompile_limit or isolate_recompiles, and its Triton interpreter needs numpy<2.4. The Compile Model files take
# over ten minutes in all; these are the ones about what differs there (under a minute).
TORCH211_COMPILE_TESTS = tests/test_compile_recompile_limit.py \
  tests/test_compile.py::test_torch_compile_without_the_newer_keywords_still_compiles \
  tests/test_compile.py::test_one_registration_of_dynamo_compile_callbacks_serves_every_listener \
  tests/test_compile_blocks.py::test_torch_compile_without_the_newer_keywords_compiles_blocks \
  'tests/test_compile_blocks.py::test_blocks_match_eager_and_reuse_graphs[sd15]'
test-torch211: setup
	@torch211="$$(bash scripts/setup_torch211.sh)" && \
	  INT8_ACCEL_EXPECT_TORCH="$$torch211" $(CURDIR)/.venv-torch211/bin/python -m pytest -q \
	    $(KERNEL_TESTS) $(TORCH211_COMPILE_TESTS) tests/test_torch_floor.py; \
	  status=$$?; $(call drop_leg_venv,.venv-torch211); exit $$status

test-server: setup-browser
	@$(PY) -m pytest tests -q -m "server or browser"

# The GPU suite and the GPU bench table: ComfyUI on the GPU and Triton compiled (not interpreted). A CPU-only
# torch is first replaced by the CUDA build of the pinned one; without a CUDA device that computes (no GPU, a
# driver the build cannot use) it stops with the reason and a non-zero exit.
test-gpu: setup
	@bash scripts/setup_gpu.sh
	@$(PY) -m harness.cuda_check
	@INT8_ACCEL_TESTS_ON_GPU=1 TRITON_INTERPRET=0 $(PY) -m pytest tests/gpu -q -m gpu
	@$(PY) bench/bench_gpu.py

# What a GPU machine without network lacks for scripts/gpu_run.sh (ComfyUI, torchsde, comfy-kitchen), in the
# git-ignored .gpu-bundle/; and the whole GPU run in one command on a machine with a CUDA torch (docs/gpu.md).
gpu-bundle:
	@bash scripts/gpu_bundle.sh

gpu-run:
	@bash scripts/gpu_run.sh

demo: setup
	@$(PY) -m scripts.demo

# Retrain the small diffusion models of harness/weights/ (deterministic, one thread, about ten CPU minutes each
# on an idle machine): python -m harness.train --kind sd15|flux|wan21 retrains one.
train-models: setup
	@$(PY) -m harness.train

bench: setup
	@for b in bench/bench_*.py; do $(PY) $$b || exit 1; done

lint: setup
	@$(PY) -m ruff check .
