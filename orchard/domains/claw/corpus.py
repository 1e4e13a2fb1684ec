"""Text for training the tiny model's tokenizer offline: everything the Claw harnesses show or say."""

from __future__ import annotations

import copy
from collections.abc import Iterable

from orchard.domains.claw import world
from orchard.domains.claw.convention import FINAL_TEXT, REACT_SYSTEM, TEXT_SYSTEM, format_text_action
from orchard.domains.claw.tasks import ClawTask
from orchard.domains.claw.teacher import react_turn_text

_SYSTEM_REPEATS = 40
"""The fixed prompt text recurs in every sample, so it is weighted up to earn whole-word merges."""


def tokenizer_corpus(tasks: Iterable[ClawTask]) -> list[str]:
    """System prompts, tool signatures, requests, the teacher's turns in both conventions and the observations
    they produce (the world is run in-process; nothing touches a sandbox)."""
    signatures = "\n".join(
        f"- {name}({', '.join(f'{p}: {t}' for p, t in params.items())}): {desc}"
        for name, (desc, params) in world.TOOLS.items()
    )
    texts = [REACT_SYSTEM, TEXT_SYSTEM, signatures] * _SYSTEM_REPEATS
    for task in tasks:
        if not isinstance(task, ClawTask):
            raise ValueError(f"tasks must hold ClawTask objects, got {type(task).__name__}")
        texts.append(task.prompt)
        state = copy.deepcopy(task.state)
        for name, arguments in task.plan:
            texts.append(react_turn_text(name, arguments))
            texts.append(format_text_action(name, arguments))
            texts.append("Observation: " + world.apply_tool(state, name, arguments))
        texts.extend([FINAL_TEXT, f"Final: {FINAL_TEXT}"])
    return texts
