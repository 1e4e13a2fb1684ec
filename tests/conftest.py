"""Fixtures more than one test folder needs: the tiny vision-language model and the screenshots it looks at."""

import base64
import io
from collections.abc import Callable

import numpy as np
import pytest


@pytest.fixture(scope="module")
def tiny_vl():
    """``(model, tokenizer, image_processor)`` of `orchard.models.tiny.tiny_vl_chat_model` (seed 0): a fresh one
    per test module, as tests put it in eval mode or leave gradients on it."""
    from orchard.models.tiny import tiny_vl_chat_model

    return tiny_vl_chat_model(seed=0)


@pytest.fixture(scope="session")
def screenshot() -> Callable[[int, int, int], dict]:
    """``screenshot(width, height, seed)``: an ``image_url`` content part holding a PNG of seeded random pixels as
    a data URL; the same arguments give the same part."""
    from PIL import Image

    def part(width: int, height: int, seed: int) -> dict:
        pixels = np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
        return {"type": "image_url", "image_url": {"url": url}}

    return part
