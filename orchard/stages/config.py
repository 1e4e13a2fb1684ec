"""The stages' typed configs: what every recipe's YAML fills for rollouts, evaluation, SFT and RL.

A recipe embeds these dataclasses in its own config (next to its domain's model and task fields); each field has a
doc line under it (``python recipes/<name>.py --show-config`` prints them with the values that will run). Fields a
stage derives (the trainers' ``total_steps``, ``seed``, ``output_dir``, ``resume``, and the RL trainer's
``checkpoint_every``) are set by the stage, never by the user: `derived_keys` names them for the config loader to
refuse (the SFT stage always starts its trainer fresh; the RL stage resumes when ``rl.resume`` says).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from orchard.sampling import GROUP_FILTER_RULES, BARConfig, difficulty_filter
from orchard.train.objective import LossTerm
from orchard.train.trainer import OptimConfig, TrainConfig

__all__ = ["EvalConfig", "RLConfig", "RolloutConfig", "SFTConfig", "TaskFilterConfig", "derived_keys"]

REWARDS = ("outcome", "score")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _positive_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


@dataclass
class RolloutConfig:
    max_steps: int = 6
    """Assistant turns per episode."""
    max_tokens: int = 96
    """Tokens per assistant turn."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts."""
    concurrency: int = 32
    """Episodes in flight at once (and concurrent sandboxes)."""
    max_time_s: float = 600.0
    """Wall-clock budget of one episode; an episode over it ends as time_budget (the paper: 10 minutes)."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "max_tokens", "concurrency"):
            _positive_int(name, getattr(self, name))
        _positive_number("max_time_s", self.max_time_s)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")


@dataclass
class EvalConfig:
    attempts: int = 3
    """Episodes per held-out task (pass@k and pass^k use k = attempts)."""
    temperature: float = 1.0
    """Sampling temperature of evaluation episodes."""
    harnesses: list[str] = field(default_factory=lambda: ["react", "text"])
    """Harnesses evaluated."""
    progress_interval_s: float = 60.0
    """Seconds between the "still running" lines of a long evaluation."""

    def __post_init__(self) -> None:
        _positive_int("attempts", self.attempts)
        if isinstance(self.progress_interval_s, bool) or not isinstance(self.progress_interval_s, (int, float)) \
                or not self.progress_interval_s > 0:
            raise ValueError(f"progress_interval_s must be a number > 0, got {self.progress_interval_s!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not self.harnesses:
            raise ValueError("harnesses must name at least one harness, got []")


@dataclass
class SFTConfig:
    enabled: bool = True
    """Run the SFT stage."""
    epochs: float = 2.0
    """Passes over the demonstrations (sets train.total_steps)."""
    max_len: int | None = None
    """Context length in tokens: a longer sample is left-truncated to it, keeping its prompt (the paper: 64K,
    65536); null trains whole samples."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        global_batch_size=16, micro_batch_size=16, optim=OptimConfig(lr=1e-5, min_lr=1e-6)))
    """Trainer settings (objective: sft; total_steps, seed, output_dir and resume are set by the stage)."""

    def __post_init__(self) -> None:
        _positive_number("epochs", self.epochs)
        if self.max_len is not None:
            _positive_int("max_len", self.max_len)


@dataclass
class TaskFilterConfig:
    enabled: bool = True
    """Train RL only on tasks of useful difficulty (`filter_tasks`); false: RL draws from the whole pool."""
    attempts: int = 8
    """Initial rollouts of the starting policy per candidate task, spread over the trained harnesses (the paper: 8)."""
    low: float = 0.0
    """Keep a task when low < p̂ (the paper: 0)."""
    high: float = 0.5
    """... and p̂ <= high (the paper: 0.5)."""
    candidates: int = 0
    """Candidate tasks rated: 0 rates the whole pool (the paper); n > 0 rates n drawn from it with the run's seed
    (`candidates_of`), which bounds the filter's cost when the pool is large."""

    def __post_init__(self) -> None:
        _positive_int("attempts", self.attempts)
        if isinstance(self.candidates, bool) or not isinstance(self.candidates, int) or self.candidates < 0:
            raise ValueError(f"candidates must be an int >= 0, got {self.candidates!r}")
        difficulty_filter([[0.0]], low=self.low, high=self.high)  # the rule's own checks of the bounds

    def candidates_of(self, tasks: list, seed: int) -> list:
        """The tasks to rate: all of ``tasks`` when ``candidates`` is 0 or covers them, else ``candidates`` of them
        drawn without replacement by ``random.Random(seed)``, in pool order."""
        if not self.candidates or self.candidates >= len(tasks):
            return list(tasks)
        chosen = sorted(random.Random(seed).sample(range(len(tasks)), self.candidates))
        return [tasks[i] for i in chosen]


@dataclass
class RLConfig:
    enabled: bool = True
    """Run the RL stage."""
    steps: int = 150
    """Rollout batches (each followed by ppo_epochs x mini_batches optimizer steps)."""
    tasks_per_step: int = 8
    """Tasks per rollout batch (paper: 8)."""
    group_size: int = 8
    """Episodes per task, N (paper: 8)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch (1: one on-policy update per batch)."""
    mini_batches: int = 1
    """Optimizer steps per pass (the batch is split into this many shuffled mini-batches)."""
    use_bar: bool = False
    """Select each group with Balanced Adaptive Rollout (generate up to bar_n_max, keep group_size)."""
    bar_n_max: int = 16
    """BAR budget of episodes per task (paper: 16)."""
    bar_stride: int = 16
    """BAR episodes generated per round (paper: 16)."""
    bar_rho_min: float = 0.375
    """BAR's balanced band, lower end: smallest share of positives in a kept group (paper: 0.375)."""
    bar_rho_max: float = 0.625
    """BAR's balanced band, upper end: largest share of positives in a kept group (paper: 0.625)."""
    reward: str = "outcome"
    """Trajectory reward: "outcome" (the verifier's +1 / -1, the paper's) or "score" (2 x the verifier's score
    component - 1: partial credit; success is still judged by the evaluation's pass rule)."""
    normalize_std: bool = True
    """Divide each group's advantages by its reward std (GRPO, the paper's), or not (False: Dr.GRPO, Liu et al.
    2025: the reward minus the group mean, so a group whose rewards differ a little, as partial-credit "score"
    rewards do, moves the policy a little rather than as much as a win against a loss)."""
    group_filter: str = "all_equal"
    """Dynamic sampling: a rule of orchard.sampling.GROUP_FILTER_RULES ("all_equal" drops groups whose trained
    rewards are all equal, no GRPO signal; "all_zero_or_all_positive" is the paper's GUI rule), or "none" (keep every
    group with two or more trained members)."""
    drop_timeouts: bool = True
    """Episodes ended by the wall-clock budget do not train (the paper's "timeouts dropped")."""
    async_rollouts: bool = False
    """Generate step k+1's rollouts while step k trains (one step off-policy): each sample carries the policy
    version that sampled it, and stale ones train with the importance correction of the policy term
    (tis_threshold, is_mode; truncated IS by default) against a ratio anchored at the current policy."""
    checkpoint_every: int = 0
    """Save the stage (trainer, step, task draws, history, pending rollouts) every this many rollout steps under
    output_dir/checkpoints (0: never)."""
    resume: bool = False
    """Continue from output_dir's latest RL checkpoint when one exists (the engine first gets its weights)."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        global_batch_size=64, micro_batch_size=16, optim=OptimConfig(lr=1e-6, min_lr=1e-7),
        objective=[LossTerm("policy", 1.0, {"eps_low": 0.2, "eps_high": 0.28})]))
    """Trainer settings (objective: policy; total_steps = steps x ppo_epochs x mini_batches, set by the stage)."""

    def __post_init__(self) -> None:
        for name in ("steps", "tasks_per_step", "group_size", "ppo_epochs", "mini_batches", "bar_n_max",
                     "bar_stride"):
            _positive_int(name, getattr(self, name))
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) \
                or self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be an int >= 0, got {self.checkpoint_every!r}")
        if not isinstance(self.normalize_std, bool):
            raise ValueError(f"normalize_std must be a bool, got {self.normalize_std!r}")
        if self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {list(REWARDS)}, got {self.reward!r}")
        if self.group_filter != "none" and self.group_filter not in GROUP_FILTER_RULES:
            raise ValueError(f"group_filter must be one of {[*GROUP_FILTER_RULES.names(), 'none']}, "
                             f"got {self.group_filter!r}")
        if self.use_bar and self.bar_n_max < self.group_size:
            raise ValueError(f"bar_n_max must be >= group_size when use_bar, got {self.bar_n_max} < {self.group_size}")
        if self.use_bar:
            try:
                self.bar_config()
            except ValueError as exc:
                raise ValueError(f"bar_rho_min / bar_rho_max: {exc}") from exc

    def bar_config(self) -> BARConfig:
        """BAR's hyperparameters: keep group_size of up to bar_n_max, bar_stride per round, band [rho_min, rho_max]."""
        return BARConfig(n=self.group_size, n_max=self.bar_n_max, stride=self.bar_stride,
                         rho_min=self.bar_rho_min, rho_max=self.bar_rho_max)


def derived_keys(sft: str | None = "sft", rl: str | None = "rl") -> dict[str, str]:
    """The trainer fields the stages set themselves, by dotted key under a recipe's ``sft`` / ``rl`` blocks (None:
    the recipe has no such block), each with what it is derived from (for ``load_config(..., derived=)`` and
    ``format_config(..., derived=)``)."""
    out: dict[str, str] = {}
    if sft is not None:
        out[f"{sft}.train.total_steps"] = f"{sft}.epochs"
    if rl is not None:
        out[f"{rl}.train.total_steps"] = f"{rl}.steps x {rl}.ppo_epochs x {rl}.mini_batches"
        # The stage checkpoints between rollout steps only: a save mid-batch could not resume exactly.
        out[f"{rl}.train.checkpoint_every"] = f"{rl}.checkpoint_every"
        out[f"{rl}.train.resume"] = f"{rl}.resume"
    for prefix in (p for p in (sft, rl) if p is not None):
        out[f"{prefix}.train.seed"] = "seed"
        out[f"{prefix}.train.output_dir"] = "output_dir"
    return out
