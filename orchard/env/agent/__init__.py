"""The exec agent: runs commands, file operations, patches and terminals inside one sandbox.

`SandboxAgent` is the in-process core (used directly by the local backend); `python -m orchard.env.agent`
serves one workspace over HTTP for a sandbox that is a machine or pod of its own.
"""

from orchard.env.agent.core import SandboxAgent
from orchard.env.agent.files import Workspace
from orchard.env.agent.isolation import BUBBLEWRAP, PROCESS_GROUP, Isolation, Limits, probe_bubblewrap
from orchard.env.agent.process import TIMEOUT_EXIT_CODE, run_captured
from orchard.env.agent.pty import LocalPty

__all__ = [
    "BUBBLEWRAP",
    "PROCESS_GROUP",
    "TIMEOUT_EXIT_CODE",
    "Isolation",
    "Limits",
    "LocalPty",
    "SandboxAgent",
    "Workspace",
    "probe_bubblewrap",
    "run_captured",
]
