"""orchard.rewards: reward formulas and verification rules (layer 1: pure functions, no I/O).

Rubric process reward (RPR) and its judge parser, Claw-Eval task score, Orchard-GUI reward, WorkForge /
SoftwareGym hybrid selection rules, and head+tail compression of long observations for judge prompts.
"""

from orchard.rewards.compress import MIN_MAX_CHARS, compress_observation
from orchard.rewards.outcome import ClawScore, GUIReward, claw_task_score, gui_reward
from orchard.rewards.rubric import (
    RPR_WEIGHTS,
    RubricJudgement,
    find_json,
    parse_rubric_judgement,
    rubric_reward,
)
from orchard.rewards.selection import (
    HYBRID_RULES,
    hybrid_select,
    two_stage_select,
    workforge_llm_select,
    workforge_programmatic_select,
    workforge_select,
)

__all__ = [
    "HYBRID_RULES",
    "MIN_MAX_CHARS",
    "RPR_WEIGHTS",
    "ClawScore",
    "GUIReward",
    "RubricJudgement",
    "claw_task_score",
    "compress_observation",
    "find_json",
    "gui_reward",
    "hybrid_select",
    "parse_rubric_judgement",
    "rubric_reward",
    "two_stage_select",
    "workforge_llm_select",
    "workforge_programmatic_select",
    "workforge_select",
]
