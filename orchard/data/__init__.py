"""orchard.data: the trajectory schema, rendering to training tensors, IO and curation (layer 2)."""

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
    "ROLES",
    "TERMINATION_REASONS",
    "Message",
    "Role",
    "TerminationReason",
    "ToolCall",
    "Trajectory",
]
