"""The repository's layout rules: tests, benches and scripts share the harness package and never import one
another (nor does the harness import them), tests never import test modules, and the kernel tier runs without
ComfyUI."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from harness.comfy_host import REPO_ROOT
from tests.support.tiers import KERNEL_TIER_PATTERN, kernel_tier_files

# top-level package -> the top-level packages it must not import
FORBIDDEN = {
    "tests": {"scripts", "bench"},
    "bench": {"tests", "scripts"},
    "scripts": {"tests", "bench"},
    "harness": {"tests", "bench", "scripts"},
}
# what a kernel-tier file must not import, and the fixtures that import ComfyUI
COMFYUI_MODULES = ("comfy", "comfy_api", "comfy_execution", "folder_paths", "nodes", "comfyui_int8_accel.nodes")
COMFYUI_FIXTURES = {"comfy_root", "pack", "server", "sd15_checkpoint", "models_dir"}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in the file, wherever it is (module level or inside a function),
    and of every constant string handed to importlib.import_module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            # `from tests import test_x` names a module through the alias
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def _python_files(package: str) -> list[Path]:
    return sorted((REPO_ROOT / package).rglob("*.py"))


def _names(module: str, packages) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


def test_tests_benches_scripts_and_the_harness_import_no_one_another():
    offences = []
    for package, forbidden in FORBIDDEN.items():
        files = _python_files(package)
        assert files, f"no Python files under {package}/"
        for path in files:
            offences += [f"{path.relative_to(REPO_ROOT)}:{line} imports {module}"
                         for line, module in _imports(path) if _names(module.split(".")[0], forbidden)]
    assert not offences, "\n".join(offences)


def test_no_test_imports_a_test_module_or_a_conftest():
    """pytest imports test modules and conftest files under names of its own: importing them again runs a second
    copy. What tests share lives in tests/support/ (fixtures of many modules in conftest.py)."""
    offences = []
    for path in _python_files("tests"):
        for line, module in _imports(path):
            last = module.split(".")[-1]
            if (module.startswith("tests.") or module == "conftest") and (last.startswith("test_") or last == "conftest"):
                offences.append(f"{path.relative_to(REPO_ROOT)}:{line} imports {module}")
    assert not offences, "\n".join(offences)


def test_the_rule_checker_sees_the_imports_it_forbids(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import scripts.demo\nfrom tests import test_quantize\n\n\ndef f():\n"
                      "    from bench.common import psnr\n    importlib.import_module('tests.conftest')\n")
    modules = [module for _, module in _imports(sample)]
    assert {"scripts.demo", "tests.test_quantize", "bench.common", "tests.conftest"} <= set(modules)


def test_kernel_tier_files_import_no_comfyui():
    files = kernel_tier_files()
    assert len(files) >= 3, files
    offences = [f"{path.relative_to(REPO_ROOT)}:{line} imports {module}"
                for path in files for line, module in _imports(path) if _names(module, COMFYUI_MODULES)]
    assert not offences, "\n".join(offences)


def test_the_kernel_tier_collects_without_importing_comfyui():
    """Collecting the kernel tier as the Makefile runs it imports no ComfyUI module, and none of its tests asks for
    a fixture that would (a test body importing ComfyUI is caught by the check above)."""
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert f"KERNEL_TESTS = tests/{KERNEL_TIER_PATTERN}" in makefile
    probe = textwrap.dedent("""
        import json, sys
        import pytest

        class Probe:
            def pytest_collection_finish(self, session):
                self.comfy = sorted(m for m in sys.modules if m.split(".")[0] in ("comfy", "comfy_api", "folder_paths")
                                    or m.startswith("comfyui_int8_accel.nodes"))
                self.items = {item.nodeid: sorted(item.fixturenames) for item in session.items}

        probe = Probe()
        code = pytest.main([*sys.argv[1:], "--collect-only", "-q"], plugins=[probe])
        print("PROBE " + json.dumps({"code": int(code), "comfy": probe.comfy, "items": probe.items}))
    """)
    files = [str(path.relative_to(REPO_ROOT)) for path in kernel_tier_files()]
    done = subprocess.run([sys.executable, "-c", probe, *files], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=600)
    line = next((text for text in done.stdout.splitlines() if text.startswith("PROBE ")), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(line[len("PROBE "):])
    assert result["code"] == 0, done.stdout[-3000:]
    assert len(result["items"]) > 100
    assert {nodeid.split("::")[0] for nodeid in result["items"]} == set(files)
    assert result["comfy"] == []
    needs_comfyui = {nodeid: sorted(COMFYUI_FIXTURES & set(fixtures))
                     for nodeid, fixtures in result["items"].items() if COMFYUI_FIXTURES & set(fixtures)}
    assert not needs_comfyui, needs_comfyui


def test_the_root_init_imports_as_a_plain_module():
    """pytest imports a test folder's root `__init__.py` as the top-level module `__init__` when the folder's name
    is no Python identifier (a clone named comfyui-int8-accel): it must load, with empty node mappings, instead of
    failing on its relative imports, or no test of such a clone can run."""
    import importlib.util

    from harness.comfy_host import REPO_ROOT

    spec = importlib.util.spec_from_file_location("__init__", REPO_ROOT / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.NODE_CLASS_MAPPINGS == {} and module.NODE_DISPLAY_NAME_MAPPINGS == {}
