"""Link the pack into a ComfyUI custom_nodes/ folder.

`link_pack(comfy_root)` is for a person who starts that ComfyUI by hand (setup.sh does the same in shell):
it creates the link when there is none and repairs a dangling one, but never re-points a link to another
live checkout of the pack, because several checkouts (git worktrees) may share one ComfyUI install and each
would steal the link from the others. Servers started by harness/server.py do not use that link: each
gets its own custom_nodes/ with `link_into` pointing at the checkout it runs from.
"""

from __future__ import annotations

from pathlib import Path

from harness.comfy_host import REPO_ROOT

LINK_NAME = "comfyui-int8-accel"


def link_into(custom_nodes: Path, pack_dir: Path = REPO_ROOT) -> Path:
    """custom_nodes/comfyui-int8-accel -> pack_dir, replacing a link that points anywhere else."""
    link = Path(custom_nodes) / LINK_NAME
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and link.resolve() != Path(pack_dir).resolve():
        link.unlink()
    if not link.exists():
        link.symlink_to(Path(pack_dir).resolve(), target_is_directory=True)
    return link


def link_pack(comfy_root: Path) -> Path:
    """The install's own custom_nodes/comfyui-int8-accel: made if missing or dangling, otherwise left as is."""
    link = Path(comfy_root) / "custom_nodes" / LINK_NAME
    if link.is_symlink() and not link.exists():
        link.unlink()  # dangling: its checkout is gone
    if not link.exists() and not link.is_symlink():
        return link_into(link.parent)
    return link
