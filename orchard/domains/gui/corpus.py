"""Text for training the tiny model's tokenizer offline: what the GUI harness shows and what the teacher did."""

from __future__ import annotations

import json
from collections.abc import Iterable

from orchard.data import Trajectory
from orchard.domains.gui.teacher import GUI_SYSTEM
from orchard.domains.gui.tools import GUI_TOOLS

__all__ = ["tokenizer_corpus"]

_SYSTEM_REPEATS = 40
"""The fixed prompt recurs in every sample: weighted up in the corpus so it earns whole-word merges."""


def tokenizer_corpus(trajectories: Iterable[Trajectory]) -> list[str]:
    """The system prompt and the tools (repeated), then every text part of every message and every tool call (name
    and arguments as JSON) of ``trajectories`` (the teacher's episodes: the policy's tokenizer is trained before it
    plays, on what the sites and the teacher wrote); images are left out."""
    texts = [GUI_SYSTEM, json.dumps(GUI_TOOLS)] * _SYSTEM_REPEATS
    for n, traj in enumerate(trajectories):
        if not isinstance(traj, Trajectory):
            raise ValueError(f"trajectories[{n}] must be a Trajectory, got {type(traj).__name__}")
        for m in traj.messages:
            parts = m.content if isinstance(m.content, list) else [{"type": "text", "text": m.content or ""}]
            texts += [p["text"] for p in parts if p.get("type") == "text"]
            texts += [json.dumps({"name": c.name, "arguments": c.arguments_dict()}) for c in m.tool_calls]
    return texts
