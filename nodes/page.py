"""Text and pictures shown on a node in the ComfyUI page while or after it runs (what the person sees, not only
the log)."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("int8_accel")


def show_on_node(text: str, node_id: str | None) -> None:
    """Show `text` on the node `node_id` of the running prompt; without a server (in-process use) the log has it."""
    if node_id is None:
        return
    try:
        from server import PromptServer

        PromptServer.instance.send_progress_text(text, node_id)
    except Exception as exc:  # noqa: BLE001 - no server or no page: nothing to show it in
        log.debug("int8-accel: no page to show %r in (%s)", text[:60], exc)


def show_image_on_node(image: torch.Tensor, node_id: str | None) -> None:
    """Show `image` (an IMAGE, [1, H, W, 3] in 0..1) as the preview of node `node_id` while the prompt runs, the
    way ComfyUI shows an output node's images: a PNG in its temp folder and an `executed` message naming it."""
    if node_id is None:
        return
    try:
        import folder_paths
        from comfy_execution.utils import get_executing_context
        from PIL import Image
        from server import PromptServer

        server = PromptServer.instance
        filename = f"int8_accel_{node_id}_{uuid.uuid4().hex[:12]}.png"
        pixels = (image[0].clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
        directory = Path(folder_paths.get_temp_directory())
        directory.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.ascontiguousarray(pixels)).save(directory / filename)
        context = get_executing_context()
        server.send_sync("executed", {
            "node": node_id, "display_node": node_id, "prompt_id": context.prompt_id if context else None,
            "output": {"images": [{"filename": filename, "subfolder": "", "type": "temp"}]}}, server.client_id)
    except Exception as exc:  # noqa: BLE001 - no server or no page: nothing to show it in
        log.debug("int8-accel: no page to show a picture in (%s)", exc)
