"""The frame: the pack imports anywhere, tiny models sample in-process, a real server lists the nodes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from harness.comfy_host import REPO_ROOT


def test_pack_imports_outside_comfyui_without_crashing():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('pack', r'{REPO_ROOT / '__init__.py'}',"
        f" submodule_search_locations=[r'{REPO_ROOT}'])\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['pack'] = m; spec.loader.exec_module(m)\n"
        "assert m.NODE_CLASS_MAPPINGS == {}, m.NODE_CLASS_MAPPINGS\n"
        "import pack.kernels\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_pack_exports_its_nodes_inside_comfyui(pack):
    assert pack.NODE_DISPLAY_NAME_MAPPINGS == {"Int8AccelQuantize": "Quantize Model (INT8)",
                                               "Int8AccelLoadModel": "Load Diffusion Model (INT8)",
                                               "Int8AccelSaveModel": "Save INT8 Model",
                                               "Int8AccelDeepCache": "DeepCache", "Int8AccelCompile": "Compile Model"}
    assert set(pack.NODE_CLASS_MAPPINGS) == set(pack.NODE_DISPLAY_NAME_MAPPINGS)


@pytest.mark.parametrize("kind", ["sd15", "sdxl", "flux", "sd3"])
def test_tiny_models_sample_deterministically(comfy_root, kind):
    from harness.tiny_models import build_tiny_model, sample

    model = build_tiny_model(kind)
    first = sample(model, kind, steps=2)
    second = sample(model, kind, steps=2)
    assert torch.isfinite(first).all()
    assert torch.equal(first, second)
    assert not torch.equal(first, sample(model, kind, steps=2, seed=1))


@pytest.mark.server
def test_server_lists_the_pack_nodes(server, pack):
    info = server.object_info()
    assert {"Int8AccelQuantize", "Int8AccelDeepCache", "Int8AccelCompile"} <= set(info)
    for key in pack.NODE_CLASS_MAPPINGS:
        assert key in info, f"{key} missing from /object_info"
        assert info[key]["python_module"].startswith("custom_nodes.")
    assert "CheckpointLoaderSimple" in info
