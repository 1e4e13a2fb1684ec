"""Images in rendering: decoding the trajectory's image parts and expanding each into its vision tokens.

A chat template of the Qwen-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; and ``build_chat_tokenizer(vision=True)``)
writes one ``<|image_pad|>`` per image part. The model wants ``grid_t * grid_h * grid_w / merge_size**2`` of them,
one per merged patch, where ``image_grid_thw = (grid_t, grid_h, grid_w)`` is what the image processor gives for
that image; this module makes that expansion, in the order the images appear in the messages, and keeps each
image's ``pixel_values`` rows (``grid_t * grid_h * grid_w`` of them) to go with the sample.

Images come as OpenAI content parts with data URLs (``data:image/png;base64,...``), as the GUI domain's
observations carry them. Layer 2 does no I/O, so a remote URL is a ``ValueError``.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from orchard.data.schema import Message
from orchard.data.tokenizer import IMAGE_TOKEN


def decode_data_url(url: str) -> Any:
    """The image of a ``data:image/...;base64,...`` URL as an RGB ``PIL.Image``.

    Raises:
        ValueError: naming ``url`` for anything but a base64 data URL of an image PIL can read.
    """
    from PIL import Image, UnidentifiedImageError

    if not isinstance(url, str) or not url.startswith("data:"):
        raise ValueError(f"url must be a base64 data URL (data:image/...;base64,...), got {str(url)[:60]!r}")
    header, sep, data = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError(f"url must be a base64 data URL (data:image/...;base64,...), got {url[:60]!r}")
    try:
        raw = base64.b64decode(data, validate=True)
        image = Image.open(io.BytesIO(raw))
        image.load()
    except (binascii.Error, UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"url {header + ',...'!r} does not hold a readable image: {exc}") from exc
    return image.convert("RGB")


@dataclass
class ImageInputs:
    """One image, processed: ``pixel_values`` ``[grid_t * grid_h * grid_w, D]`` (D = channels x temporal patch x
    patch x patch), ``grid_thw`` ``[3]`` long, and ``num_tokens`` vision tokens in the sequence."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    num_tokens: int


class VisionRenderer:
    """The images of one trajectory, processed once, and token encoders that expand ``<|image_pad|>``.

    Args:
        messages: the trajectory's messages; their image parts, in order, are the images.
        tokenizer: the chat tokenizer; ``image_token`` must be one of its tokens.
        processor: an HF processor of the Qwen-VL family (its ``image_processor`` and ``image_token`` are used) or
            a bare Qwen2-VL-style image processor (with ``merge_size``).
    """

    def __init__(self, messages: list[Message], tokenizer: Any, processor: Any) -> None:
        image_processor = getattr(processor, "image_processor", processor)
        merge = getattr(image_processor, "merge_size", None)
        if not callable(image_processor) or isinstance(merge, bool) or not isinstance(merge, int) or merge < 1:
            raise ValueError(
                "processor must be a Qwen-VL family processor or image processor (callable, with an int "
                f"merge_size), got {type(processor).__name__}"
            )
        self.image_token = getattr(processor, "image_token", None) or IMAGE_TOKEN
        ids = tokenizer(self.image_token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(
                f"tokenizer must encode the image token {self.image_token!r} as one token, got {list(ids)}; "
                "build the offline tokenizer with build_chat_tokenizer(vision=True)"
            )
        self.image_token_id = int(ids[0])
        self.tokenizer = tokenizer
        self.urls = [url for m in messages for url in m.image_urls]
        self._image_processor, self._merge = image_processor, merge
        self._cache: dict[str, ImageInputs] = {}

    def image(self, k: int) -> ImageInputs:
        """Image ``k`` (in message order), processed on first use; the same URL is processed once."""
        url = self.urls[k]
        if url not in self._cache:
            out = self._image_processor(images=[decode_data_url(url)], return_tensors="pt")
            grid = out["image_grid_thw"].reshape(-1, 3)[0].long()
            patches = int(grid.prod())
            if patches % (self._merge**2):
                raise ValueError(f"image {k}: grid {grid.tolist()} does not merge by merge_size={self._merge}")
            self._cache[url] = ImageInputs(out["pixel_values"], grid, patches // self._merge**2)
        return self._cache[url]

    def encoder(self) -> tuple[Callable[[str], list[int]], Callable[[], int]]:
        """``(encode, used)``: ``encode(text)`` tokenizes text with every ``<|image_pad|>`` expanded into the
        next image's vision tokens (the images taken in order across calls); ``used()`` counts images taken."""
        count = [0]

        def encode(text: str) -> list[int]:
            if not text:
                return []
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if self.image_token_id not in ids:
                return ids
            out: list[int] = []
            for token in ids:
                if token != self.image_token_id:
                    out.append(token)
                    continue
                if count[0] >= len(self.urls):
                    raise ValueError(
                        f"the chat template wrote more image tokens than the trajectory has images ({len(self.urls)})"
                    )
                out.extend([token] * self.image(count[0]).num_tokens)
                count[0] += 1
            return out

        return encode, lambda: count[0]

    def spans(self, ids: list[int], num_images: int) -> list[tuple[int, int]]:
        """``(start, stop)`` of each of the first ``num_images`` images' vision tokens in ``ids``."""
        positions = [t for t, token in enumerate(ids) if token == self.image_token_id]
        spans, at = [], 0
        for k in range(num_images):
            n = self.image(k).num_tokens
            spans.append((positions[at], positions[at] + n))
            at += n
        return spans

    def attach(self, sample: Any, spans: list[tuple[int, int]]) -> Any:
        """Give ``sample`` the pixels of the images whose tokens it kept (truncation never splits one:
        ``_Builder.build`` moves the cut to an image's edge) and its ``mm_token_type_ids`` (1 on image tokens)."""
        cut = sample.report.cut
        kept = [k for k, (a, b) in enumerate(spans) if cut is None or b <= cut[0] or a >= cut[1]]
        if kept:
            sample.pixel_values = torch.cat([self.image(k).pixel_values for k in kept])
            sample.image_grid_thw = torch.stack([self.image(k).grid_thw for k in kept])
        sample.mm_token_type_ids = (sample.input_ids == self.image_token_id).long()
        return sample
