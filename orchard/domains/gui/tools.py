"""The GUI agent's 13 tools (the paper's Table 12) as OpenAI tool schemas, and observations as chat content.

Coordinates are viewport pixels of the latest screenshot (x right, y down, origin top-left); `scroll`'s amount is
a fraction of the viewport (0.0-1.0); tabs are 0-based; `done(response)` is the only way an episode ends by the
policy's choice. The paper's table names the tools and their arguments; the argument names and the optional
ones here (`new_tab`'s url, `close_tab`'s tab_index defaulting to the active tab, `wait`'s seconds up to 10)
are our reading of it. Invalid arguments are not exceptions: the browser host answers them with an observation
whose `error` says what was wrong, and the episode goes on.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from orchard.data import Message


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


def _px(axis: str) -> dict[str, Any]:
    return {"type": "number", "description": f"{axis} in viewport pixels"}


GUI_TOOLS: list[dict[str, Any]] = [
    _fn("click", "Click at a point of the viewport.", {"x": _px("x"), "y": _px("y")}, ["x", "y"]),
    _fn("hover", "Move the mouse to a point of the viewport.", {"x": _px("x"), "y": _px("y")}, ["x", "y"]),
    _fn("drag", "Press the mouse at a start point, move to an end point and release.",
        {"start_x": _px("x"), "start_y": _px("y"), "end_x": _px("x"), "end_y": _px("y")},
        ["start_x", "start_y", "end_x", "end_y"]),
    _fn("write", "Type text into the focused element.", {"text": {"type": "string"}}, ["text"]),
    _fn("press_keys", "Press a key or a key combination, e.g. [\"Enter\"] or [\"Control\", \"a\"].",
        {"keys": {"type": "array", "items": {"type": "string"}}}, ["keys"]),
    _fn("scroll", "Scroll the page by a fraction of the viewport.",
        {"direction": {"type": "string", "enum": ["up", "down", "left", "right"]},
         "amount": {"type": "number", "minimum": 0.0, "maximum": 1.0}}, ["direction", "amount"]),
    _fn("goto_url", "Open a URL in the current tab.", {"url": {"type": "string"}}, ["url"]),
    _fn("go_back", "Go back in the current tab's history.", {}, []),
    _fn("wait", "Wait for the page to change.", {"seconds": {"type": "number", "minimum": 0, "maximum": 10}},
        ["seconds"]),
    _fn("new_tab", "Open a new tab (optionally at a URL) and switch to it.", {"url": {"type": "string"}}, []),
    _fn("switch_tab", "Switch to a tab.", {"tab_index": {"type": "integer", "minimum": 0,
                                                        "description": "0-based"}}, ["tab_index"]),
    _fn("close_tab", "Close a tab (default: the current one).",
        {"tab_index": {"type": "integer", "minimum": 0, "description": "0-based"}}, []),
    _fn("done", "Finish the task, with the answer or a short report.", {"response": {"type": "string"}},
        ["response"]),
]
GUI_TOOL_NAMES = tuple(t["function"]["name"] for t in GUI_TOOLS)
KEEP_LAST_IMAGES = 3
"""How many screenshots the policy's context keeps as images by default. The paper keeps "only the last k
screenshots"; the seed gives no k, so 3 is our choice."""

IMAGE_PLACEHOLDER = "[an earlier screenshot, removed]"
TEXT_VIEW_HEADER = "Page elements (role, name, centre):"
"""The line of an observation's text after which the text view's elements follow, one a line."""


@dataclass(frozen=True)
class Observation:
    """What the policy sees after an action.

    Attributes:
        screenshot: the active tab's viewport as PNG bytes (b"" when `env_error` is set or none was asked for).
        viewport: (width, height) in pixels; coordinates of the tools refer to it.
        tabs: every tab's (url, title), in tab order.
        active: the 0-based index of the active tab.
        text: the optional text view, one visible element a line: `[role] "name" @(x,y)`, the name JSON-encoded,
            with `checked` / `unchecked` for a box and `entered` for text repeating what the visitor entered
            before the centre (None when not asked).
        error: why the last action was invalid or failed (the episode goes on), else None.
        env_error: the browser or its host is gone: the rollout is an environment failure, to be dropped and
            never scored (None while the browser works).
    """

    screenshot: bytes
    viewport: tuple[int, int]
    tabs: tuple[tuple[str, str], ...]
    active: int
    text: str | None = None
    error: str | None = None
    env_error: str | None = None

    def describe(self) -> str:
        """The observation's text: the error (if any), the viewport, the tabs, and the text view (if any)."""
        lines = [f"Error: {self.env_error or self.error}"] if self.env_error or self.error else []
        lines.append(f"Viewport: {self.viewport[0]}x{self.viewport[1]}")
        lines += [f"Tab {i}{' (active)' if i == self.active else ''}: {title!r} {url}"
                  for i, (url, title) in enumerate(self.tabs)]
        if self.text is not None:
            lines += [TEXT_VIEW_HEADER, self.text]
        return "\n".join(lines)

    def to_content(self) -> list[dict[str, Any]]:
        """OpenAI chat content parts: the text of `describe()`, then the screenshot as a PNG data URL."""
        parts: list[dict[str, Any]] = [{"type": "text", "text": self.describe()}]
        if self.screenshot:
            data = base64.b64encode(self.screenshot).decode("ascii")
            parts.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}})
        return parts


def keep_last_images(messages: list[dict[str, Any]], k: int = KEEP_LAST_IMAGES) -> list[dict[str, Any]]:
    """A copy of `messages` in which only the last `k` images remain; earlier ones become a text placeholder.

    The text parts of every observation stay, so the policy still knows which URLs and errors it saw. `k = 0`
    removes every image. Messages whose content is a string are left as they are.

    Args:
        messages: OpenAI chat messages (content a string or a list of parts).
        k: how many images to keep (the most recent ones).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    positions = [(m, p) for m, message in enumerate(messages) if isinstance(message.get("content"), list)
                 for p, part in enumerate(message["content"]) if part.get("type") == "image_url"]
    drop = set(positions[:max(len(positions) - k, 0)])
    out = []
    for m, message in enumerate(messages):
        if isinstance(message.get("content"), list) and any((m, p) in drop for p in range(len(message["content"]))):
            content = [{"type": "text", "text": IMAGE_PLACEHOLDER} if (m, p) in drop else part
                       for p, part in enumerate(message["content"])]
            message = {**message, "content": content}
        out.append(message)
    return out


def policy_context(messages: Sequence[Message], keep_images: int | None) -> list[Message]:
    """``messages`` as the policy sees them: only the last ``keep_images`` screenshots kept as images
    (`keep_last_images`: earlier ones become `IMAGE_PLACEHOLDER`, their text kept); None keeps every one.

    The one rule both sides apply, so the SFT prefixes (`orchard.domains.gui.curation.turn_prefixes`) and the
    agent loop's prompts (`orchard.domains.gui.rollouts.GUIHarness.context`) show the same context. The trajectory
    itself keeps every screenshot (the judges' evidence).
    """
    if keep_images is not None and (isinstance(keep_images, bool) or not isinstance(keep_images, int)
                                    or keep_images < 0):
        raise ValueError(f"keep_images must be an int >= 0 or None, got {keep_images!r}")
    messages = list(messages)
    for i, m in enumerate(messages):
        if not isinstance(m, Message):
            raise ValueError(f"messages[{i}] must be a Message, got {type(m).__name__}")
    if keep_images is None or sum(len(m.image_urls) for m in messages) <= keep_images:
        return messages
    trimmed = keep_last_images([{"content": m.content} for m in messages], keep_images)
    # a message whose images all stay is the same object (an assistant turn keeps its sampled token ids)
    return [m if t["content"] is m.content else replace(m, content=t["content"])
            for m, t in zip(messages, trimmed, strict=True)]
