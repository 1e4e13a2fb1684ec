"""What the SWE recipe's smoke runs share (tests/recipes/test_swe_recipe.py, part 1, and test_swe_recipe_rl.py,
part 2): the recipe's command line as a subprocess, the overrides that read a real instance from disk, the check
that an RL step trained, and the checkpoints the RL smokes start from: a tiny student that has memorised the
scripted teacher's resolved trajectories, and a near-uniform OPD teacher beside it."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The RL smokes' instances: 2 train (the RL pool) and 1 held-out `inventory` instance of level 1.
RL_INSTANCES = [
    "instances.train_per_template=2", "instances.heldout_per_template=1", "instances.levels=[1]",
    "instances.templates=[inventory]",
]
# The scripted teacher's episode as the memorised student replays it: explore, reproduce, read, edit (81, ~95, 65
# and ~330 tokens: the edit quotes the hunk). The teacher's tests and submission come after the fourth turn, never
# reached; the edited repository is scored.
MEMORISED_EPISODE = ["rollout.max_steps=4", "rollout.max_tokens=400"]
# SFT until the 2 resolved trajectories are memorised: one batch of both a step, constant lr 3e-2, 105 epochs.
# Measured (epochs: final loss, then the RL smokes' rollouts resolved, grpo_bar of 8 / opd_js_grpo of 4): 75: 0.011,
# 0/8, no signal at all; 85: 0.0037, 1/8 and 1/4; 95: 0.0019, 3/8 and 3/4; 105: 0.0013, 4/8 and 3/4; 120: 0.0009,
# 5/8 and 3/4 (60 at lr 5e-2: 0.56, 0/8). 105 puts grpo_bar's resolve rate at 1/2, where a group is likeliest to
# hold both outcomes, at ~1 s more than 95.
MEMORISED_SFT = [
    *RL_INSTANCES, "harnesses=[bash]", "eval.harnesses=[bash]", *MEMORISED_EPISODE, "teacher.attempts=1",
    "teacher.failure_rate=0.0", "sft_mode=resolved", "sft.epochs=105", "sft.train.global_batch_size=2",
    "sft.train.micro_batch_size=2", "sft.train.optim.lr=3e-2", "sft.train.optim.min_lr=3e-2",
    "sft.train.optim.warmup_steps=0", "model.hidden_size=32", "model.num_layers=1", "model.vocab_size=1024",
    "rl.enabled=false", "value_model.enabled=false",
]


def recipe(*args: str, timeout: float = 540) -> subprocess.CompletedProcess:
    """``recipes/swe.py --config recipes/configs/swe_tiny.yaml *args`` in a subprocess, its output captured."""
    return subprocess.run([sys.executable, str(ROOT / "recipes/swe.py"), "--config",
                           str(ROOT / "recipes/configs/swe_tiny.yaml"), *args],
                          capture_output=True, text=True, timeout=timeout)


def real_files(real) -> list[str]:
    """The overrides that read the real instance from disk: its JSONL as every pool, its clone under repo_root."""
    return [f"instances.path={real.path}", f"instances.rl_path={real.path}", f"instances.heldout_path={real.path}",
            f"instances.repo_root={real.repo_root}"]


def assert_trained(step: dict, *, groups: int = 1, spread: bool = True) -> None:
    """An RL step's metrics row shows an optimizer step with signal: at least ``groups`` trained groups, whose
    rewards differ (``rl/groups_with_spread``; ``spread=False`` for pure distillation, whose signal is the teacher's,
    asserted apart), their sequences in the batch, a nonzero gradient and a nonzero learning rate (so the weights
    moved)."""
    assert step["rl/groups_with_signal"] >= groups and step["rl/sequences"] > 0, step
    assert not spread or step["rl/groups_with_spread"] >= groups, step
    assert step["grad_norm"] > 0 and step["lr"] > 0, step


def metrics_rows(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def memorised_student(out: Path) -> Path:
    """The recipe's own SFT (MEMORISED_SFT) run in ``out``: the tiny student after it has memorised the scripted
    teacher's resolved trajectories of the RL smokes' 2 train instances; returns its checkpoint (``model.path``).

    The untrained tiny student resolves nothing, so every group of an outcome-reward RL step is all -1 and dropped;
    this one, sampled at the rollout temperature, replays a resolving episode often but not always, which gives the
    groups both outcomes. Nothing in the library knows: it is a policy that happens to have learned the two tasks."""
    proc = recipe(f"output_dir={out}", *MEMORISED_SFT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [teacher] = [row for row in metrics_rows(out / "metrics.jsonl") if "sft/resolved" in row]
    assert teacher["sft/resolved"] == 2, teacher  # one resolved trajectory per train instance to memorise
    sft = metrics_rows(out / "sft" / "metrics.jsonl")
    assert sft[-1]["loss/total"] < 0.005, sft[-1]  # memorised (75 epochs' 0.011 resolves nothing)
    return out / "sft_model"


def uniform_teacher(student: Path, out: Path) -> Path:
    """A checkpoint for ``rl.teacher.path`` in ``out``: a fresh tiny Qwen3 wider than the student (48 x 1; the
    CPU teacher the recipe trains itself goes only with a tiny student it builds) with the student's tokenizer. Its
    random weights make it near-uniform: an OPD smoke with it proves the plumbing, not that distillation teaches."""
    from orchard.models import tiny_qwen3
    from orchard.models.pretrained import load_chat_tokenizer
    from orchard.stages.policy import save_policy

    tokenizer = load_chat_tokenizer(student)
    h = 48
    save_policy(tiny_qwen3(tokenizer, seed=1, hidden_size=h, intermediate_size=3 * h, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=h // 4), tokenizer, out)
    return out
