"""orchard.stages: what every recipe repeats, once (layer 6, beside the domains; never imports a domain).

A recipe composes these with its domain's choices (tasks, harnesses, teacher, verifier) in one screen::

    harnesses = {"react": AgentLoopRollouts(client, harness, tokenizer, ...), "text": ClawTextRollouts(...)}
    results["base"] = await evaluate(harnesses, engine, heldout, attempts=3, temperature=1.0)
    samples, stats = await demonstrations(harnesses, teacher, train_tasks)
    sft_stage(model, samples, cfg.sft, pad_id=..., seed=..., output_dir=...)
    await rl_stage(model, engine, harnesses, train_tasks, cfg.rl, rollout=cfg.rollout, ...)

- configs: `RolloutConfig`, `EvalConfig`, `SFTConfig`, `RLConfig`, `TaskFilterConfig` (typed, a doc line per field), `derived_keys`
- evaluation: `evaluate`, `success_row` (success, pass@k, pass^k, tasks, env errors), `format_table` (in
  `orchard.stages.report`, importable from `orchard.stages.evaluate` too)
- the teacher phase (`orchard.stages.teacher`): `TeacherConfig` (a teacher by URL, or the domain's scripted one;
  attempts, temperature), `url_teacher` (an OpenAI-compatible endpoint as an engine, its tokenizer checked to be
  the student's), `sample_teacher` (attempts per task through the policy's harnesses, failures kept),
  `teacher_phase` (either teacher, played and closed), `check_tokenizers`
- SFT: `demonstrations` (a teacher through the same harnesses), `curate_sft` (the paper's curation: over the
  context limit, invalid or unparseable calls), `sft_samples` (resolved-only, all, or credit-assigned SFT from
  hindsight step values), `sft_stage`, `sft_steps` (the optimizer steps it takes)
- task filter: `filter_tasks` (initial rollouts per candidate task, keep 0 < p̂ <= 0.5), `split_attempts`,
  `TaskFilterResult`
- a policy's best sampling temperature (`orchard.stages.temperature`): `search_temperature` (validation success
  per temperature of a grid, the best mean over the harnesses), `best_temperature` (ties nearest a reference),
  `TemperatureSearch`, `TEMPERATURE_GRID`, `check_temperatures`; `start_at_best_temperature` (RL's start: the
  search, logged, and its choice folded into the policy with `orchard.models.fold_temperature`)
- RL: `rl_stage`, `rollout_groups` (plain groups or BAR), `bar_candidate` (what BAR may choose: not removed, not
  a dropped timeout), `bar_groups` (BAR's positive ratio per group, as it chose), `group_batch` (a group into
  samples and advantages), `trajectory_reward`; a recipe's RL phase (`orchard.stages.rl_phase`): `rl_phase` (the
  task filter, then `rl_stage` on the kept tasks, each in its warm pool; every rollout kept or none, a summary),
  `RLPhaseResult`
- on-policy distillation (`orchard.stages.distill`): `teacher_logprobs` (a teacher engine's log-probs on the
  student's action tokens), `check_teacher`, `OPD_TERMS`; `rl_stage(..., teacher=...)` uses them; `opd_teacher`
  (an `OPDTeacherConfig`'s teacher: by URL, a checkpoint, or a larger tiny model trained here)
- value model: `value_rerank_stage` (pool, train, best-of-N rerank vs random and oracle), `value_rerank_phase`
  (a recipe's step, configured by `ValueRerankConfig`: the final policy's candidates, the value model, the stage, ``rerank.json`` and the plot),
  `RecordedRollouts` (keeps what a stage generated, for the pool), `plot_value_curves`, `ValueRerankResult`
- reporting: `RunLog` (metrics.jsonl + timestamped console lines), `evaluate_stage` (evaluate, log, print),
  `plot_learning_curve`, `write_results`; a recipe's command line: `recipe_main`
- a recipe's run (`orchard.stages.recipe_run`): `RecipeRun` (seeds, the log, held-out results per stage, the SFT
  hand-over to the engine, the end: engine closed, results written by rank 0); `prepare_output_dir` /
  `previous_run` (a previous run in ``output_dir`` is refused, moved aside or resumed, never deleted)
- sandboxes (`orchard.stages.sandboxes`): `sandbox_service` (a service by URL, or the embedded one for the run
  with its shared folders), `PooledSandboxes` (what the harnesses create sandboxes from: a warm pool per stage,
  capped by the run), `pooled_sandboxes` (the two, with a client, for a run's block)
- ranks (`orchard.stages.ranks`): `Ranks`, `init_ranks`, `shard_range`, `all_gather_concat`, `all_reduce_sum`;
  `evaluate` and `rl_stage` shard their tasks over the launcher's ranks by themselves
"""

from orchard.stages.config import (
    EvalConfig,
    RLConfig,
    RolloutConfig,
    SFTConfig,
    TaskFilterConfig,
    derived_keys,
)
from orchard.stages.distill import OPD_TERMS, OPDTeacherConfig, opd_teacher, teacher_logprobs
from orchard.stages.evaluate import evaluate, evaluate_stage, success_row
from orchard.stages.recipe_run import RecipeRun
from orchard.stages.report import (
    RUN_LOGGERS,
    RunLog,
    format_table,
    plot_learning_curve,
    provenance,
    recipe_main,
    write_results,
)
from orchard.stages.rl import (
    bar_candidate,
    bar_groups,
    group_batch,
    rl_stage,
    rollout_groups,
    trajectory_reward,
)
from orchard.stages.rl_phase import RLPhaseResult, rl_phase
from orchard.stages.run_files import EXISTING_RUN_CHOICES, prepare_output_dir, previous_run
from orchard.stages.sandboxes import PooledSandboxes, pooled_sandboxes, sandbox_service
from orchard.stages.sft import SFT_MODES, curate_sft, demonstrations, sft_samples, sft_stage, sft_steps
from orchard.stages.task_filter import TaskFilterResult, filter_tasks, split_attempts
from orchard.stages.teacher import TeacherConfig, check_tokenizers, sample_teacher, teacher_phase, url_teacher
from orchard.stages.temperature import (
    TEMPERATURE_GRID,
    TemperatureSearch,
    best_temperature,
    check_temperatures,
    search_temperature,
    start_at_best_temperature,
)
from orchard.stages.value_rerank import (
    RecordedRollouts,
    ValueRerankConfig,
    ValueRerankResult,
    plot_value_curves,
    value_rerank_phase,
    value_rerank_stage,
)

__all__ = [
    "EXISTING_RUN_CHOICES",
    "OPD_TERMS",
    "RUN_LOGGERS",
    "SFT_MODES",
    "TEMPERATURE_GRID",
    "EvalConfig",
    "OPDTeacherConfig",
    "PooledSandboxes",
    "RLConfig",
    "RLPhaseResult",
    "RecipeRun",
    "RecordedRollouts",
    "RolloutConfig",
    "RunLog",
    "SFTConfig",
    "TaskFilterConfig",
    "TaskFilterResult",
    "TeacherConfig",
    "TemperatureSearch",
    "ValueRerankConfig",
    "ValueRerankResult",
    "bar_candidate",
    "bar_groups",
    "best_temperature",
    "check_temperatures",
    "check_tokenizers",
    "curate_sft",
    "demonstrations",
    "derived_keys",
    "evaluate",
    "evaluate_stage",
    "filter_tasks",
    "format_table",
    "group_batch",
    "opd_teacher",
    "plot_learning_curve",
    "plot_value_curves",
    "pooled_sandboxes",
    "prepare_output_dir",
    "previous_run",
    "provenance",
    "recipe_main",
    "rl_phase",
    "rl_stage",
    "rollout_groups",
    "sample_teacher",
    "sandbox_service",
    "search_temperature",
    "sft_samples",
    "sft_stage",
    "sft_steps",
    "split_attempts",
    "start_at_best_temperature",
    "success_row",
    "teacher_logprobs",
    "teacher_phase",
    "trajectory_reward",
    "url_teacher",
    "value_rerank_phase",
    "value_rerank_stage",
    "write_results",
]
