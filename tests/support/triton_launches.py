"""Which autotuned Triton kernels a test launches, in order (needs no ComfyUI: the kernel tier uses it too)."""

from __future__ import annotations

from types import ModuleType


def record_launches(monkeypatch, triton_kernels: ModuleType) -> list[str]:
    """The list the names of `triton_kernels`' autotuned kernels are appended to as they launch, from now until
    `monkeypatch` undoes its changes."""
    names: list[str] = []
    autotuned_run = triton_kernels.ChosenConfigAutotuner.run

    def counting_run(self, *args, **kwargs):
        names.append(self.base_fn.__name__)
        return autotuned_run(self, *args, **kwargs)

    monkeypatch.setattr(triton_kernels.ChosenConfigAutotuner, "run", counting_run)
    return names
