"""A scripted SWE teacher, served as an inference engine, that works like a careful engineer and sometimes errs.

`SWETeacherEngine` implements the rollout `Engine` protocol, so it plays the policy in every SWE harness — the
bash and tool conventions of the separate program (`orchard.domains.swe.tool_harness`, behind the recording
proxy) and the in-process evaluation convention (`orchard.domains.swe.harness`) — and its episodes become SFT
trajectories through the code paths the model's own rollouts take. It recognises the convention from the system
prompt and the instance from the issue in the first user message; it holds the instances and reads their gold
``patch`` to know the fix (its privilege, as Claw's teacher holds the task table). It does not read observations:
its plan is fixed when the episode starts.

A careful episode: explore (list the Python files), reproduce (run the issue's snippets, printing a final
expression), locate (view each file the fix touches), edit (one exact replacement per hunk of the gold patch),
test (the snippets again, then pytest on the test files the hidden tests touch), submit.

Noise (``failure_rate``, seeded): with that probability an attempt is a failure of one of `FAILURE_KINDS`, drawn
uniformly among those the instance allows, each of which leaves the instance unresolved by construction:

- ``wrong_file``: it suspects and edits a module the fix does not touch, its visible tests pass, it submits;
- ``partial``: it fixes only the first place of a fix with several hunks (level-3 instances, two places);
- ``regression``: it fixes the bug, then "tidies" another module in a way that breaks a passing test (the inverse
  of another toy instance's gold patch of the same template: a bug verified to break a test; toy instances only);
- ``untested``: it edits the buggy line without changing its behaviour and submits without running anything.

An attempt's kind is drawn when its first turn is asked for, from ``(seed, instance_id, attempt index)``: the
``k``-th episode started on an instance gets `attempt_kind` ``(instance, k)``, so a group of 5 attempts gets a
fixed multiset of kinds whatever the concurrency. Each kind opens with its own first sentence, from which the
later turns (and `kind_of`) recover it. The paper keeps the teacher's failures: `teacher_trajectories` plays
`ATTEMPTS_PER_TASK` (5) attempts per task and returns them all.
"""

from __future__ import annotations

import ast
import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchard.data import Trajectory
from orchard.domains.swe.convention import BASH_SYSTEM, EVAL_SYSTEM, SUBMIT_COMMAND, TOOL_SYSTEM, WORKSPACE
from orchard.domains.swe.instances import SWEInstance
from orchard.domains.swe.sandbox import patched_paths
from orchard.rollout.engine import Completion, GenerateRequest, GenerateResult, validate_requests

FAILURE_KINDS = ("wrong_file", "partial", "regression", "untested")
"""The failure modes the teacher's noise draws from."""

ATTEMPTS_PER_TASK = 5
"""Teacher attempts per task, failures kept, as in the paper."""

DEFAULT_FAILURE_RATE = 0.3
"""Default share of attempts that are failures (our choice: the paper gives no teacher success rate for SWE)."""

OPENINGS = {
    "careful": "Let me start by exploring the repository structure.",
    "wrong_file": "I suspect the problem is in {wrong}; let me see the repository first.",
    "partial": "Let me explore the repository, then go after the first problem the issue reports.",
    "regression": "Let me explore the repository; I will tidy the code around the fix as I go.",
    "untested": "This looks like a small fix; I will find the line and change it.",
}
"""The first sentence of each kind's first turn (how later turns recover the attempt's kind)."""

_TURN = "<|im_start|>"
_END = "<|im_end|>"
_ISSUE = re.compile(r"<issue>\n(.*?)\n</issue>", re.S)
_SNIPPET = re.compile(r"```python\n(.*?)```", re.S)


@dataclass(frozen=True)
class Edit:
    """One exact replacement in one file (``old`` empty: create the file with ``new``)."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Step:
    """One abstract action of a plan, rendered per convention."""

    thought: str
    kind: str
    """'list', 'run', 'view', 'edit' or 'submit'."""
    command: str = ""
    path: str = ""
    edit: Edit | None = None


def patch_edits(patch: str) -> list[Edit]:
    """One `Edit` per hunk of a unified diff: the hunk's old side (context and removed lines) to its new side
    (context and added lines); a file the diff creates is one edit with an empty ``old``."""
    edits: list[Edit] = []
    path, old, new, creating = "", [], [], False

    def flush() -> None:
        if path and (old or new):
            edits.append(Edit(path, "" if creating else "".join(old), "".join(new)))

    for line in patch.splitlines(keepends=True):
        if line.startswith("diff --git "):
            flush()
            path, old, new, creating = "", [], [], False
        elif line.startswith("--- "):
            creating = line.strip() == "--- /dev/null"
        elif line.startswith("+++ "):
            target = line[4:].strip()
            path = target[2:] if target.startswith("b/") else target
        elif line.startswith("@@"):
            flush()
            old, new = [], []
        elif path and line[:1] in (" ", "-", "+"):
            if line[0] != "+":
                old.append(line[1:])
            if line[0] != "-":
                new.append(line[1:])
    flush()
    return edits


def _tweaked(line: str) -> str:
    """A line changed without changing what it does (the edit of an engineer who believed it fixed)."""
    body = line.rstrip("\n")
    return body + "  # checked\n" if not body.rstrip().endswith("\\") else line


def _reproduction(problem_statement: str) -> str:
    """A shell command that runs the issue's snippets, printing a final bare expression's value."""
    scripts = []
    for snippet in _SNIPPET.findall(problem_statement):
        try:
            tree = ast.parse(snippet)
        except SyntaxError:
            continue
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            lines = snippet.rstrip("\n").splitlines()
            start = tree.body[-1].lineno - 1
            last = "\n".join(lines[start:])
            snippet = "\n".join([*lines[:start], f"print(repr({last}))"]) + "\n"
        scripts.append(f"python3 - <<'SNIPPET'\n{snippet.rstrip()}\nSNIPPET")
    return "\n".join(scripts)


class SWETeacherEngine:
    """An `Engine` whose samples are a scripted engineer's turns on known SWE instances (log-probs 0).

    Args:
        tokenizer: the chat tokenizer the policy uses.
        instances: the instances it may be asked about (distinct issues).
        failure_rate: the share of attempts that fail (one of ``kinds``), in [0, 1]. Default 0.3
            (`DEFAULT_FAILURE_RATE`); 0 gives a teacher that resolves every instance it can.
        kinds: the failure kinds to draw from, a non-empty subset of `FAILURE_KINDS`. Default all.
        seed: the noise's seed. Default 0.
    """

    def __init__(self, tokenizer: Any, instances: Iterable[SWEInstance], *,
                 failure_rate: float = DEFAULT_FAILURE_RATE, kinds: Sequence[str] = FAILURE_KINDS,
                 seed: int = 0) -> None:
        if isinstance(failure_rate, bool) or not isinstance(failure_rate, (int, float)) or not 0 <= failure_rate <= 1:
            raise ValueError(f"failure_rate must be a number in [0, 1], got {failure_rate!r}")
        if isinstance(kinds, str) or not kinds or any(k not in FAILURE_KINDS for k in kinds):
            raise ValueError(f"kinds must be a non-empty subset of {list(FAILURE_KINDS)}, got {kinds!r}")
        self.tokenizer = tokenizer
        self.failure_rate = float(failure_rate)
        self.kinds = tuple(kinds)
        self.seed = seed
        self.instances: dict[str, SWEInstance] = {}
        for instance in instances:
            if not isinstance(instance, SWEInstance):
                raise ValueError(f"instances must hold SWEInstance, got {type(instance).__name__}")
            key = instance.problem_statement.strip()
            if key in self.instances and self.instances[key].patch != instance.patch:
                raise ValueError(f"instances must have distinct issues; {instance.instance_id} repeats "
                                 f"{self.instances[key].instance_id}")
            self.instances[key] = instance
        self._starts: dict[str, int] = {}
        self._regressions: dict[str, list[Edit] | None] = {}
        self._wrong: dict[str, str | None] = {}

    # ---- noise ----------------------------------------------------------------------------------------------

    def _wrong_module(self, instance: SWEInstance) -> str | None:
        """The module the ``wrong_file`` kind suspects (cached): a Python module the fix and the tests do not
        touch, with a line to edit, one beside a fixed module first (a real repository has docs and scripts too)."""
        if instance.instance_id in self._wrong:
            return self._wrong[instance.instance_id]
        touched = {e.path for e in patch_edits(instance.patch)}
        tests = set(patched_paths(instance.test_patch))
        beside = {str(Path(p).parent) for p in touched}
        candidates = sorted((p for p in instance.paths() if p.endswith(".py") and p not in touched
                             and p not in tests and not p.endswith("__init__.py") and "test" not in Path(p).name),
                            key=lambda p: (str(Path(p).parent) not in beside, p))
        wrong = next((p for p in candidates if (instance.read(p) or "").strip()), None)
        self._wrong[instance.instance_id] = wrong
        return wrong

    def _regression_edits(self, instance: SWEInstance) -> list[Edit] | None:
        """The inverse of another toy instance's gold patch in a module the fix does not touch (cached)."""
        if instance.instance_id in self._regressions:
            return self._regressions[instance.instance_id]
        edits = None
        template, seed = instance.extras.get("template"), instance.extras.get("seed")
        if instance.files is not None and isinstance(template, str) and isinstance(seed, int):
            from orchard.domains.swe.generator import GenerationError, make_instance

            touched = {e.path for e in patch_edits(instance.patch)}
            for other_seed in range(seed + 1, seed + 40):
                try:
                    other = make_instance(template, other_seed, level=1)
                except GenerationError:
                    continue
                other_edits = patch_edits(other.patch)
                if other_edits and not touched & {e.path for e in other_edits}:
                    edits = [Edit(e.path, e.new, e.old) for e in other_edits]
                    break
        self._regressions[instance.instance_id] = edits
        return edits

    def allowed_kinds(self, instance: SWEInstance) -> list[str]:
        """The failure kinds this instance allows, among ``kinds``."""
        allowed = []
        for kind in self.kinds:
            if kind == "wrong_file" and self._wrong_module(instance) is None:
                continue
            if kind == "partial" and len(patch_edits(instance.patch)) < 2:
                continue
            if kind == "regression" and self._regression_edits(instance) is None:
                continue
            allowed.append(kind)
        return allowed

    def attempt_kind(self, instance: SWEInstance, attempt: int) -> str:
        """The kind of the ``attempt``-th episode started on ``instance``: ``careful`` or a failure kind."""
        rng = random.Random(f"{self.seed}/{instance.instance_id}/{attempt}")
        if rng.random() >= self.failure_rate:
            return "careful"
        allowed = self.allowed_kinds(instance)
        return rng.choice(allowed) if allowed else "careful"

    # ---- plans ----------------------------------------------------------------------------------------------

    def plan(self, instance: SWEInstance, kind: str) -> list[Step]:
        """The abstract steps of one attempt of ``kind`` (``careful`` or one of `FAILURE_KINDS`)."""
        gold = patch_edits(instance.patch)
        files = list(dict.fromkeys(e.path for e in gold))
        reproduce = _reproduction(instance.problem_statement)
        tests = [p for p in dict.fromkeys(patched_paths(instance.test_patch)) if instance.read(p) is not None]
        pytest = "python3 -m pytest -q -p no:cacheprovider" + "".join(f" {p}" for p in tests)
        wrong = self._wrong_module(instance) or ""
        steps = [Step(OPENINGS[kind].format(wrong=wrong), "list")]
        if kind != "untested" and reproduce:
            steps.append(Step("Let me reproduce the problem the issue describes.", "run", reproduce))
        if kind == "wrong_file":
            text = instance.read(wrong) or ""
            lines = [ln for ln in text.splitlines(keepends=True) if ln.strip().startswith("return ")
                     and text.count(ln) == 1]
            line = lines[0] if lines else text.splitlines(keepends=True)[0]
            steps += [Step(f"Let me read {wrong}.", "view", path=wrong),
                      Step(f"This must be where {wrong} goes wrong; let me fix it.", "edit",
                           edit=Edit(wrong, line, _tweaked(line)))]
        else:
            edits = gold[:1] if kind == "partial" else gold
            if kind == "untested":
                first = gold[0]
                removed = next((ln for ln in first.old.splitlines(keepends=True)
                                if ln not in first.new.splitlines(keepends=True)), "")
                edits = [Edit(first.path, first.old, first.old.replace(removed, _tweaked(removed), 1))]
            for path in dict.fromkeys(e.path for e in edits) if kind != "untested" else files[:1]:
                steps.append(Step(f"Let me read {path}, where the behaviour in the issue comes from.", "view",
                                  path=path))
            for n, edit in enumerate(edits, 1):
                steps.append(Step(f"Fix the cause in {edit.path} ({n} of {len(edits)}).", "edit", edit=edit))
            if kind == "regression":
                for edit in self._regression_edits(instance) or []:
                    steps.append(Step(f"While here, simplify {edit.path}.", "edit", edit=edit))
        if kind != "untested":
            if reproduce and kind != "regression":
                steps.append(Step("Let me check that the reproduction now behaves as the issue expects.", "run",
                                  reproduce))
            steps.append(Step("Let me run the existing tests of the code I touched.", "run", pytest))
        steps.append(Step("The fix is complete; submitting.", "submit"))
        return steps

    # ---- rendering ------------------------------------------------------------------------------------------

    @staticmethod
    def _bash(step: Step) -> str:
        if step.kind == "list":
            return "find . -name '*.py' -not -path './.git/*' | sort"
        if step.kind == "run":
            return step.command
        if step.kind == "view":
            return f"cat -n {step.path}"
        if step.kind == "submit":
            return SUBMIT_COMMAND
        edit = step.edit
        assert edit is not None
        return ("python3 - <<'EDIT'\nfrom pathlib import Path\n"
                f"path, old, new = Path({edit.path!r}), {edit.old!r}, {edit.new!r}\n"
                "text = path.read_text() if old else ''\n"
                "assert not old or text.count(old) == 1, 'the old text is not in the file exactly once'\n"
                "path.parent.mkdir(parents=True, exist_ok=True)\n"
                "path.write_text(text.replace(old, new, 1) if old else new)\nprint('edited', path)\nEDIT")

    @staticmethod
    def _tool_call(step: Step) -> tuple[str, dict[str, Any]]:
        if step.kind == "list":
            return "str_replace_editor", {"command": "view", "path": WORKSPACE}
        if step.kind == "run":
            return "execute_bash", {"command": step.command}
        if step.kind == "view":
            return "str_replace_editor", {"command": "view", "path": f"{WORKSPACE}/{step.path}"}
        if step.kind == "submit":
            return "finish", {"message": "Fixed the issue."}
        edit = step.edit
        assert edit is not None
        path = f"{WORKSPACE}/{edit.path}"
        if not edit.old:
            return "str_replace_editor", {"command": "create", "path": path, "file_text": edit.new}
        return "str_replace_editor", {"command": "str_replace", "path": path, "old_str": edit.old,
                                      "new_str": edit.new}

    @staticmethod
    def _eval_call(step: Step) -> tuple[str, dict[str, Any]]:
        if step.kind == "list":
            return "run_command", {"command": "find . -name '*.py' -not -path './.git/*' | sort"}
        if step.kind == "run":
            return "run_command", {"command": step.command}
        if step.kind == "view":
            return "read_file", {"path": step.path}
        if step.kind == "submit":
            return "done", {"summary": "Fixed the issue."}
        edit = step.edit
        assert edit is not None
        if not edit.old:
            return "write_file", {"path": edit.path, "content": edit.new}
        return "replace_in_file", {"path": edit.path, "old": edit.old, "new": edit.new}

    def render(self, step: Step, convention: str) -> str:
        """One assistant turn of ``step`` in ``convention`` ('bash', 'tool' or 'eval')."""
        if convention == "bash":
            return f"THOUGHT: {step.thought}\n\n```bash\n{self._bash(step)}\n```"
        name, arguments = (self._tool_call if convention == "tool" else self._eval_call)(step)
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{step.thought}\n<tool_call>\n{call}\n</tool_call>"

    # ---- reading the prompt ---------------------------------------------------------------------------------

    def _kind_from_opening(self, first_turn: str, instance: SWEInstance) -> str:
        wrong = self._wrong_module(instance) or ""
        for kind, opening in OPENINGS.items():
            if opening.format(wrong=wrong) in first_turn:
                return kind
        return "careful"

    def kind_of(self, trajectory: Trajectory) -> str:
        """The kind of a finished teacher episode, read from its first assistant turn."""
        user = next((m.text for m in trajectory.messages if m.role == "user"), "")
        instance = self._instance_of(user)
        first = next((m.text for m in trajectory.messages if m.role == "assistant"), "")
        return self._kind_from_opening(first, instance)

    def _instance_of(self, user_text: str) -> SWEInstance:
        match = _ISSUE.search(user_text)
        instance = self.instances.get(match.group(1).strip()) if match else None
        if instance is None:
            raise ValueError(f"the teacher does not know the issue in {user_text[:120]!r}")
        return instance

    def next_turn(self, prompt_text: str) -> str:
        """The teacher's next assistant turn (without the end-of-turn token) for a rendered prompt."""
        turns = [t.split(_END)[0] for t in prompt_text.split(_TURN)]
        system = next((t[len("system\n"):] for t in turns if t.startswith("system\n")), "")
        convention = ("bash" if system.startswith(BASH_SYSTEM) else "tool" if system.startswith(TOOL_SYSTEM)
                      else "eval" if system.startswith(EVAL_SYSTEM) else None)
        if convention is None:
            raise ValueError(f"the teacher does not know the harness of the system prompt {system[:80]!r}")
        user = next((t[len("user\n"):] for t in turns if t.startswith("user\n")), None)
        if user is None:
            raise ValueError("prompt_text holds no user turn")
        instance = self._instance_of(user)
        done = [t[len("assistant\n"):] for t in turns if t.startswith("assistant\n")][:-1]
        if not done:
            attempt = self._starts.get(instance.instance_id, 0)
            self._starts[instance.instance_id] = attempt + 1
            kind = self.attempt_kind(instance, attempt)
        else:
            kind = self._kind_from_opening(done[0], instance)
        steps = self.plan(instance, kind)
        return self.render(steps[min(len(done), len(steps) - 1)], convention)

    # ---- the Engine protocol --------------------------------------------------------------------------------

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        results = []
        for request in validate_requests(requests):
            prompt_text = self.tokenizer.decode(list(request.prompt_ids))
            completions = []
            for _ in range(request.params.n):
                ids = self.tokenizer.encode(self.next_turn(prompt_text) + self.tokenizer.eos_token,
                                            add_special_tokens=False)[: request.params.max_tokens]
                finish = "stop" if ids and ids[-1] == self.tokenizer.eos_token_id else "length"
                completions.append(Completion(list(ids), [0.0] * len(ids), finish))
            results.append(GenerateResult(tuple(request.prompt_ids), completions))
        return results

    async def update_weights(self, weights: Any) -> None:
        raise NotImplementedError("the scripted teacher has no weights")

    async def close(self) -> None:
        return None


async def teacher_trajectories(rollouts: Any, teacher: SWETeacherEngine, instances: Sequence[SWEInstance], *,
                               attempts: int = ATTEMPTS_PER_TASK, max_tokens: int = 4096) -> list[Trajectory]:
    """``attempts`` teacher episodes per instance through one harness's `orchard.rollout.Rollouts`, failures
    kept (the paper's 5 attempts per task); task-major, as the Rollouts returns them."""
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be an int >= 1, got {attempts!r}")
    if isinstance(instances, (str, bytes)) or not isinstance(instances, Sequence) or not instances:
        raise ValueError(f"instances must be a non-empty sequence of SWEInstance, got {instances!r:.80}")
    return await rollouts(teacher, instances, group_size=attempts, temperature=0.0, max_tokens=max_tokens)
