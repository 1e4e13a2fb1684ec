"""The GUI domain (Orchard-GUI): a browser agent in sandboxes.

A Chromium per sandbox driven by Playwright inside it (`BrowserSession`), offline seeded sites served beside it
(`sites`), the paper's 13 tools (`GUI_TOOLS`) and observations as chat content (`Observation`,
`keep_last_images`). See docs/gui.md.
"""

from orchard.domains.gui.session import BROWSER_MEMORY, BrowserSession
from orchard.domains.gui.tools import (
           GUI_TOOL_NAMES,
           GUI_TOOLS,
           IMAGE_PLACEHOLDER,
           Observation,
           keep_last_images,
)

__all__ = ["BROWSER_MEMORY", "GUI_TOOLS", "GUI_TOOL_NAMES", "IMAGE_PLACEHOLDER", "BrowserSession", "Observation",
           "keep_last_images"]
