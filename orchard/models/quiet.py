"""Loading and saving a Hugging Face model without transformers' progress bars or an unasked DeepSpeed import
(shared by training's `load_causal_lm` / `save_causal_lm` and the conversion of a fetched checkpoint)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

__all__ = ["quiet_transformers"]


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Within the block: no transformers progress bars (``Loading weights``, ``Writing model shards``) and no
    DeepSpeed import on transformers' behalf unless DeepSpeed is already imported.

    ``save_pretrained`` unwraps the model through accelerate, which imports DeepSpeed whenever it is installed
    just to test ``isinstance(model, DeepSpeedEngine)``; that import logs "Setting accelerator to CPU" on a CPU
    machine. A model cannot be a DeepSpeed engine unless DeepSpeed was imported, so answering "not available"
    until then gives the same unwrapping without the import. Under the DeepSpeed engine nothing changes.
    """
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    patched = None
    with contextlib.suppress(ImportError):
        import accelerate.utils.other as accelerate_other

        patched = accelerate_other
    original = getattr(patched, "is_deepspeed_available", None)
    if patched is not None and original is not None and "deepspeed" not in sys.modules:
        patched.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        if patched is not None and original is not None:
            patched.is_deepspeed_available = original
        if bars:
            hf_logging.enable_progress_bar()
