"""Make sure the pack is linked into ComfyUI's custom_nodes/ (setup.sh does the same in shell)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LINK_NAME = "comfyui-int8-accel"


def link_pack(comfy_root: Path) -> Path:
    link = Path(comfy_root) / "custom_nodes" / LINK_NAME
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and link.resolve() != REPO_ROOT.resolve():
        link.unlink()
    if not link.exists():
        link.symlink_to(REPO_ROOT, target_is_directory=True)
    return link
