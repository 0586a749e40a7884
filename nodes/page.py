"""Text shown on a node in the ComfyUI page while or after it runs (what the person sees, not only the log)."""

from __future__ import annotations

import logging

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
