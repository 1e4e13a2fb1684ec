"""SFT data for the GUI agent, as the paper curates it from the teacher's rollouts.

1. The teacher plays 4 rollouts per task (`teacher.teacher_trajectories`); each is judged (the checker, or the
   two-stage judge of `orchard.domains.gui.judge`), so a success has reward 1.
2. `curate_sft` keeps the shortest successful rollout of each task (fewest assistant turns, the earliest on a
   tie; `orchard.data.shortest_successful_per_task`), then at most K tasks per website (`site_of`: the shop, the
   forms site, the information site), drawn with a seed (`orchard.data.cap_per_key`).
3. `sft_turn_samples` serializes one sample per assistant turn: the prefix the policy saw before the turn (as
   context, never supervised) and that one turn as the target (`orchard.data.render_turns`). With
   ``keep_images=k`` each prefix keeps only its last k screenshots as images (`policy_context`), as the agent's
   context does at that step (the agent loop applies the same rule: `GUIHarness.context`).

The paper's rule: the shortest success per task, at most K = `MAX_TASKS_PER_SITE` (20) tasks per website, one
target turn per prefix. The seed issue says "at most K tasks per website"; K = 20 is the paper's value as issue 33
quotes it. Removed rollouts (``metadata["removed"]``: captcha, judge failure) never count as successes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from orchard.data import (
    RenderedSample,
    Trajectory,
    cap_per_key,
    render_turns,
    shortest_successful_per_task,
)
from orchard.domains.gui.tasks import GUITask
from orchard.domains.gui.tools import policy_context

__all__ = ["MAX_TASKS_PER_SITE", "curate_sft", "sft_turn_samples", "site_of"]

MAX_TASKS_PER_SITE = 20
"""The paper's K: the most tasks per website whose teacher trajectory SFT keeps."""


def site_of(task: GUITask) -> str:
    """The website a task is on: the first segment of its start path (``shop``, ``forms``, ``info``)."""
    if not isinstance(task, GUITask):
        raise ValueError(f"task must be a GUITask, got {type(task).__name__}")
    return task.start_path.strip("/").split("/")[0]


def curate_sft(trajectories: Iterable[Trajectory], tasks: Sequence[GUITask] | Mapping[str, GUITask], *,
               max_tasks_per_site: int | None = MAX_TASKS_PER_SITE, seed: int = 0) -> list[Trajectory]:
    """The teacher's SFT trajectories: the shortest success of each task, at most ``max_tasks_per_site`` tasks
    per website.

    Args:
        trajectories: the judged teacher rollouts (``task_id`` set; a success has ``reward >= 1``).
        tasks: their tasks (a list, or a mapping by id), for the website of each.
        max_tasks_per_site: K, the most tasks kept per website (chosen at random with ``seed``); default 20, the
            paper's; None keeps all.
        seed: the draw's seed.

    Returns:
        At most one trajectory per task, in the order the tasks first appear among ``trajectories``.
    """
    items = list(trajectories)
    for i, t in enumerate(items):
        if not isinstance(t, Trajectory):
            raise ValueError(f"trajectories[{i}] must be a Trajectory, got {type(t).__name__}")
    by_id = dict(tasks) if isinstance(tasks, Mapping) else {getattr(t, "id", None): t for t in tasks}
    if max_tasks_per_site is not None and (isinstance(max_tasks_per_site, bool)
                                           or not isinstance(max_tasks_per_site, int) or max_tasks_per_site < 0):
        raise ValueError(f"max_tasks_per_site must be an int >= 0 or None, got {max_tasks_per_site!r}")
    missing = sorted({str(t.task_id) for t in items} - set(by_id))
    if missing:
        raise ValueError(f"tasks has no task for the trajectories' task ids {missing[:5]}")
    best = shortest_successful_per_task([t for t in items if not t.metadata.get("removed")], success_threshold=1.0)
    if max_tasks_per_site is None:
        return best
    return cap_per_key(best, lambda t: site_of(by_id[t.task_id]), max_tasks_per_site, seed=seed)


def turn_prefixes(traj: Trajectory, keep_images: int) -> list[Trajectory]:
    """Per assistant turn of ``traj``, the conversation up to and including that turn as the agent saw it: only the
    last ``keep_images`` screenshots of its prefix kept as images (earlier ones `IMAGE_PLACEHOLDER`, their text
    kept), trimmed over ``messages[:i]``, not over the whole run (`policy_context`, the agent loop's rule too)."""
    out = []
    for i in traj.assistant_indices:
        prefix = [*policy_context(traj.messages[:i], keep_images), traj.messages[i]]
        out.append(Trajectory(prefix, traj.tools, traj.reward, task_id=traj.task_id, group_id=traj.group_id))
    return out


def sft_turn_samples(trajectories: Iterable[Trajectory], tokenizer: Any, *, keep_images: int | None = None,
                     max_len: int | None = None, processor: Any = None) -> list[RenderedSample]:
    """One sample per assistant turn of each trajectory: the serialized prefix before the turn (context) and the
    turn itself (the only supervised tokens), in trajectory then turn order.

    Args:
        trajectories: the curated trajectories (`curate_sft`).
        tokenizer: the policy's chat tokenizer (its template renders the prefixes).
        keep_images: keep only the last ``k`` screenshots of each prefix as images (`turn_prefixes`); None keeps
            the messages as recorded.
        max_len: each sample's longest length (truncated as `render_turns` does); None: no limit.
        processor: a Qwen-VL processor (or image processor) for trajectories with screenshots (`render_turns`);
            None for text-only trajectories.
    """
    if keep_images is not None and (isinstance(keep_images, bool) or not isinstance(keep_images, int)
                                    or keep_images < 0):
        raise ValueError(f"keep_images must be an int >= 0 or None, got {keep_images!r}")
    samples: list[RenderedSample] = []
    for n, traj in enumerate(trajectories):
        if not isinstance(traj, Trajectory):
            raise ValueError(f"trajectories[{n}] must be a Trajectory, got {type(traj).__name__}")
        if keep_images is None or sum(len(m.image_urls) for m in traj.messages) <= keep_images:  # nothing to trim
            samples += render_turns(traj, tokenizer, max_len=max_len, processor=processor)
            continue
        for turn in turn_prefixes(traj, keep_images):
            samples.append(render_turns(turn, tokenizer, max_len=max_len, processor=processor)[-1])
    return samples
