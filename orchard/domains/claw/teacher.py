"""A scripted teacher that solves Claw tasks, served as an inference engine.

The teacher implements the rollout `Engine` protocol, so it plays the policy inside either harness — the in-process
ReAct agent loop or the separate text-harness program behind the recording proxy — and its episodes become SFT
trajectories through exactly the code paths the model's own rollouts take. It reads the conversation from the
prompt ids: the user's request names the task (the teacher holds the task table, which is its privilege), and the
number of assistant turns so far says which step of the task's plan comes next. After the plan, it finishes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from orchard._extras import requires_extra

with requires_extra("all"):
    from transformers import PreTrainedTokenizerBase

from orchard.domains.claw.convention import FINAL_TEXT, TEXT_SYSTEM, format_text_action
from orchard.domains.claw.tasks import ClawTask
from orchard.rollout.engine import Completion, GenerateRequest, GenerateResult, validate_requests

_TURN = "<|im_start|>"


def react_turn_text(name: str, arguments: dict[str, Any]) -> str:
    """The assistant turn of the ReAct harness for one tool call, as our chat template renders it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>'


class TeacherEngine:
    """An `Engine` whose samples are the scripted solutions of known tasks (log-probs are 0: it is deterministic).

    Args:
        tokenizer: the chat tokenizer the policy uses.
        tasks: the tasks it may be asked about; their prompts must be distinct.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tasks: Iterable[ClawTask]):
        self.tokenizer = tokenizer
        self.tasks: dict[str, ClawTask] = {}
        for task in tasks:
            if task.prompt in self.tasks and self.tasks[task.prompt].plan != task.plan:
                raise ValueError(f"tasks must have distinct prompts; {task.id} repeats {self.tasks[task.prompt].id}")
            self.tasks[task.prompt] = task
        self.eos = tokenizer.eos_token

    def next_turn(self, prompt_text: str) -> str:
        """The teacher's next assistant turn (without the end-of-turn token) for a rendered prompt."""
        turns = prompt_text.split(_TURN)
        text_harness = any(t.startswith("system\n" + TEXT_SYSTEM) for t in turns)
        user_turns = [t for t in turns if t.startswith("user\n")]
        if not user_turns:
            raise ValueError("prompt_text holds no user turn")
        request = user_turns[0][len("user\n"):].split("<|im_end|>")[0]
        task = self.tasks.get(request)
        if task is None:
            raise ValueError(f"the teacher does not know the task {request[:80]!r}")
        done = sum(1 for t in turns if t.startswith("assistant\n")) - 1
        if done < len(task.plan):
            name, arguments = task.plan[done]
            return format_text_action(name, arguments) if text_harness else react_turn_text(name, arguments)
        return f"Final: {FINAL_TEXT}" if text_harness else FINAL_TEXT

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        results = []
        for request in validate_requests(requests):
            prompt_text = self.tokenizer.decode(list(request.prompt_ids))
            ids = self.tokenizer.encode(self.next_turn(prompt_text) + self.eos, add_special_tokens=False)
            ids = ids[: request.params.max_tokens]
            finish = "stop" if ids and ids[-1] == self.tokenizer.eos_token_id else "length"
            completions = [Completion(list(ids), [0.0] * len(ids), finish) for _ in range(request.params.n)]
            results.append(GenerateResult(tuple(request.prompt_ids), completions))
        return results

    async def update_weights(self, weights: Any) -> None:
        raise NotImplementedError("the scripted teacher has no weights")

    async def close(self) -> None:
        return None
