"""orchard.data: the trajectory schema, rendering to training tensors, IO and curation (layer 2)."""

from orchard.data.render import (
    MISMATCH_POLICIES,
    MismatchPolicy,
    RenderedSample,
    RenderReport,
    TurnMismatch,
    collate,
    render_trajectory,
    render_turns,
)
from orchard.data.schema import (
    ROLES,
    TERMINATION_REASONS,
    Message,
    Role,
    TerminationReason,
    ToolCall,
    Trajectory,
)

__all__ = [
    "MISMATCH_POLICIES",
    "ROLES",
    "TERMINATION_REASONS",
    "Message",
    "MismatchPolicy",
    "RenderReport",
    "RenderedSample",
    "Role",
    "TerminationReason",
    "ToolCall",
    "Trajectory",
    "TurnMismatch",
    "collate",
    "render_trajectory",
    "render_turns",
]
