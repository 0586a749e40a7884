"""Without CUDA the GPU suite's module skips at collection, which pytest reports as "no tests collected" (exit
5); that is the expected outcome there, so `make test-gpu` succeeds with the one skip line."""

import pytest
import torch


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and not torch.cuda.is_available():
        session.exitstatus = pytest.ExitCode.OK
