"""ComfyUI 0.38's `ModelPatcher.clone(disable_dynamic=False, ...)` on the real 0.3.75 patcher.

What 0.38.1 adds to cloning (comfy/model_patcher.py, stored copy of commit 08d0e510f4e539a1db39072589817136ac6cfa7d):
a clone keeps its patcher's class, so a dynamic-VRAM patcher's clones are dynamic too, and it carries
`cached_patcher_init`. `clone(disable_dynamic=True)` on a dynamic patcher returns a plain `ModelPatcher` around a
model loaded again by `cached_patcher_init[0](*cached_patcher_init[1], disable_dynamic=True)`, with the patches,
options, wrappers and attachments of the clone it stands for and backups of its own (the fresh model has none);
without `cached_patcher_init` it raises "Cannot create non-dynamic delegate: cached_patcher_init is not
initialized.". On a patcher that is not dynamic, `disable_dynamic` changes nothing. 0.3.75's own clone does the
copying here; whether a patcher is dynamic is `comfy038.make_dynamic`'s stand-in (an `is_dynamic()` that answers
True).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

from tests.support import comfy038


@contextlib.contextmanager
def cloning_038(monkeypatch) -> Iterator[None]:
    """0.38.1's `ModelPatcher.clone` in force inside."""
    import comfy.model_patcher

    from comfyui_int8_accel.nodes.comfy_contracts import is_dynamic

    original = comfy.model_patcher.ModelPatcher.clone

    def clone(self, disable_dynamic: bool = False, model_override=None, force_deepcopy: bool = False):
        init = getattr(self, "cached_patcher_init", None)
        if is_dynamic(self) and disable_dynamic:
            if init is None:
                raise RuntimeError("Cannot create non-dynamic delegate: cached_patcher_init is not initialized.")
            delegate = init[0](*init[1], disable_dynamic=True)
            n = original(self)
            n.model = delegate.model
            n.backup, n.object_patches_backup, n.pinned = {}, {}, set()
            n.cached_patcher_init = init
            return n  # a plain ModelPatcher: no is_dynamic() of its own
        n = original(self)
        n.cached_patcher_init = init
        if is_dynamic(self):
            n.is_dynamic = lambda: True
            n.restore_loaded_backups = types.MethodType(comfy038.restore_loaded_backups, n)
        return n

    with monkeypatch.context() as patch:
        patch.setattr(comfy.model_patcher.ModelPatcher, "clone", clone)
        yield
