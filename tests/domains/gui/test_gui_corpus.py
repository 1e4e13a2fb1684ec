"""The tiny tokenizer's corpus of the GUI domain (`tokenizer_corpus`): the fixed prompt and tools weighted up, every
text part and tool call of the teacher's episodes, no image."""

import json

import pytest

from orchard.data import Message, ToolCall, Trajectory
from orchard.domains.gui.corpus import tokenizer_corpus
from orchard.domains.gui.teacher import GUI_SYSTEM
from orchard.domains.gui.tools import GUI_TOOLS

SHOT = {"type": "image_url", "image_url": {"url": "data:image/png;base64,c2hvdA=="}}


def test_the_corpus_holds_the_prompt_the_tools_and_every_text_and_call():
    episode = Trajectory(messages=[
        Message("system", GUI_SYSTEM),
        Message("user", [{"type": "text", "text": "[button] \"Buy\" @(40,12)"}, SHOT]),
        Message("assistant", None, tool_calls=[ToolCall("click", {"x": 40, "y": 12}, id="c1")]),
        Message("tool", "clicked", tool_call_id="c1"),
    ])
    texts = tokenizer_corpus([episode])
    fixed = [GUI_SYSTEM, json.dumps(GUI_TOOLS)]
    assert texts[:80] == fixed * 40 and tokenizer_corpus([]) == fixed * 40  # weighted up: 40 copies
    # the episode in order: the system prompt again, the page's text (its screenshot left out), the assistant's
    # empty content, the call as JSON, the tool's answer
    assert texts[80:] == [GUI_SYSTEM, "[button] \"Buy\" @(40,12)", "",
                          json.dumps({"name": "click", "arguments": {"x": 40, "y": 12}}), "clicked"]


def test_only_trajectories_make_a_corpus():
    with pytest.raises(ValueError, match=r"^trajectories\[0\] must be a Trajectory, got str$"):
        tokenizer_corpus(["a page"])
