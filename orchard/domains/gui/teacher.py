"""A scripted GUI teacher that solves tasks with the 13 tools by reading the text view, and sometimes errs.

The teacher acts like a text-only browser agent: every action is one of the paper's tools with coordinates taken
from the latest observation's text view (`[role] "name" @(x,y)`, the element's centre), and every value it
reports is read from the page, not from the task. It knows the task's hidden parameters (which product, city or
form values: its privilege, as the Claw teacher holds its task table) and scrolls when what it looks for is not
on screen. Its episodes are `Trajectory`s in the library's format: system, user (intent + first observation),
then assistant tool calls and tool observations, ending with its `done` call.

Noise (``failure_rate``, seeded): with that probability an attempt is a failure of one of `FAILURE_KINDS`:

- ``distracted``: it follows the start page's distractor banner, then another, and gives up (where the start
  page has no banner it gives up at once);
- ``wrong_value``: it reads or enters a neighbouring value (the next row, the runner-up, one more item, the
  next day, another language);
- ``early_done``: it declares itself done after its first action.

An attempt's kind is a function of ``(seed, task id, attempt index)``. `teacher_trajectories` plays
`ATTEMPTS_PER_TASK` (4, as in the paper) attempts per task and returns them all, failures kept; the captcha's
runs come back with ``reward`` None (dropped, `gui_reward`'s ``blocked_page``) and ``metadata["blocked"]``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import Any

from orchard.data import Message, ToolCall, Trajectory
from orchard.domains.gui.session import BrowserSession
from orchard.domains.gui.sites import BANNERS
from orchard.domains.gui.tasks import GUITask, check_task
from orchard.domains.gui.tools import GUI_TOOLS, Observation
from orchard.env import SandboxClient
from orchard.rewards import gui_reward

FAILURE_KINDS = ("distracted", "wrong_value", "early_done")
"""The failure modes the teacher's noise draws from."""

ATTEMPTS_PER_TASK = 4
"""Teacher rollouts per task, as in the paper (Orchard-GUI's SFT data)."""

DEFAULT_FAILURE_RATE = 0.25
"""Default share of attempts that are failures (our choice: the paper gives no teacher success rate)."""

GUI_SYSTEM = ("You operate a web browser with tools. Each observation lists the tabs and the page's visible "
              "elements as [role] \"name\" @(x,y), the centre of the element in viewport pixels. Act with one tool "
              "call per turn and finish with done(response), giving the answer when the task asks a question.")

_ELEMENT = re.compile(r'^\[(\w+)\] (".*?")(?: (checked|unchecked))?(?: entered)? @\((\d+),(\d+)\)$')
_MONEY = re.compile(r"\$(\d+)")
_SCROLLS = 5


@dataclass(frozen=True)
class Element:
    """One line of the text view."""

    role: str
    name: str
    x: int
    y: int


def parse_text_view(text: str | None) -> list[Element]:
    """The text view's elements, in page order (lines that are not elements are skipped)."""
    out = []
    for line in (text or "").splitlines():
        m = _ELEMENT.match(line)
        if m:
            name = m.group(2)[1:-1].replace('\\"', '"')
            out.append(Element(m.group(1), name, int(m.group(4)), int(m.group(5))))
    return out


class _Stuck(Exception):
    """What the teacher looks for is not on the page: it gives up (done), like an agent would."""


Action = tuple[str, dict[str, Any]]
Program = Generator[Action, Observation, str]


class _Agent:
    """The teacher's reading of the current observation, and the moves every program shares."""

    def __init__(self, obs: Observation) -> None:
        self.obs = obs

    def elements(self) -> list[Element]:
        return parse_text_view(self.obs.text)

    def find(self, role: str, name: str, *, exact: bool = True) -> Element | None:
        for el in self.elements():
            if el.role == role and (el.name == name if exact else name in el.name):
                return el
        return None

    def reach(self, role: str, name: str, *, exact: bool = True) -> Generator[Action, Observation, Element]:
        """Scroll down (then back up) until the element is on screen."""
        for direction in ("down", "up"):
            for _ in range(_SCROLLS + 1):
                el = self.find(role, name, exact=exact)
                if el is not None:
                    return el
                self.obs = yield "scroll", {"direction": direction, "amount": 0.8}
        raise _Stuck(f"no [{role}] {name!r} on the page")

    def click(self, role: str, name: str, *, exact: bool = True) -> Generator[Action, Observation, None]:
        el = yield from self.reach(role, name, exact=exact)
        self.obs = yield "click", {"x": el.x, "y": el.y}

    def fill(self, role: str, name: str, text: str) -> Generator[Action, Observation, None]:
        """Click a text box, select what it holds and type over it."""
        yield from self.click(role, name)
        self.obs = yield "press_keys", {"keys": ["Control", "a"]}
        self.obs = yield "write", {"text": text}

    def choose(self, current: str, option: str) -> Generator[Action, Observation, None]:
        """Pick an option of a drop-down (shown by its current option) by typing it, as a keyboard user does."""
        yield from self.click("combobox", current)
        self.obs = yield "write", {"text": option}
        self.obs = yield "press_keys", {"keys": ["Enter"]}

    def cell_after(self, header: str) -> str:
        """The table cell that follows the row header `header` (a fact table: one th and one td a row)."""
        elements = self.elements()
        for i, el in enumerate(elements[:-1]):
            if el.role == "columnheader" and el.name == header and elements[i + 1].role == "cell":
                return elements[i + 1].name
        raise _Stuck(f"no row {header!r}")

    def rows(self) -> list[list[str]]:
        """The visible table's body rows (cells grouped by their centre's y)."""
        by_y: dict[int, list[str]] = {}
        for el in self.elements():
            if el.role == "cell":
                by_y.setdefault(el.y, []).append(el.name)
        return [by_y[y] for y in sorted(by_y)]


def _number(text: str) -> int:
    m = re.search(r"\d[\d,]*", text)
    if m is None:
        raise _Stuck(f"no number in {text!r}")
    return int(m.group().replace(",", ""))


def _program(task: GUITask, agent: _Agent, kind: str) -> Program:
    """The teacher's actions for one attempt; returns the `done` response."""
    p, wrong = task.params, kind == "wrong_value"
    if kind == "distracted":
        banner = next((el for el in agent.elements() if el.role == "link" and el.name in BANNERS), None)
        if banner is not None:
            agent.obs = yield "click", {"x": banner.x, "y": banner.y}
            yield from agent.click("link", "", exact=False)
        return "I could not find what was asked."
    if kind == "early_done":
        agent.obs = yield "scroll", {"direction": "down", "amount": 0.5}
        return "I could not finish the task."
    if task.template == "shop_cart":
        agent.obs = yield "goto_url", {"url": BrowserSession.url(
            f"/shop/?category={p['category']}&color={p['color']}&sort=price_asc")}
        items = [el.name for el in agent.elements() if el.role == "listitem" and _MONEY.search(el.name)]
        if not items:
            raise _Stuck("no products listed")
        name = items[0].split(" - ")[0]
        yield from agent.click("link", name)
        yield from agent.fill("textbox", "1", str(p["quantity"] + wrong))
        yield from agent.click("button", "Add to cart")
        return f"Added {p['quantity'] + wrong} x {name} to the cart."
    if task.template == "shop_price":
        agent.obs = yield "goto_url", {"url": BrowserSession.url(f"/shop/?category={p['category']}&sort=rating")}
        items = [el.name for el in agent.elements() if el.role == "listitem" and _MONEY.search(el.name)]
        if len(items) < 1 + wrong:
            raise _Stuck("no products listed")
        price = _MONEY.search(items[int(wrong)]).group(1)
        return f"The best-rated one costs ${price}."
    if task.template == "form_booking":
        yield from agent.click("link", "Book a room")
        yield from agent.fill("textbox", "name", p["name"])
        date = p["date"][:-2] + f"{int(p['date'][-2:]) + wrong:02d}"
        yield from agent.fill("textbox", "YYYY-MM-DD", date)
        yield from agent.choose("1", str(p["guests"]))
        yield from agent.click("radio", p["room"])
        if p["breakfast"]:
            yield from agent.click("checkbox", "Breakfast")
        yield from agent.click("button", "Book")
        return f"Booked a {p['room']} room for {p['name']} on {date}."
    if task.template == "form_settings":
        yield from agent.fill("textbox", "guest", p["display_name"])
        language = "German" if wrong and p["language"] != "German" else "French" if wrong else p["language"]
        yield from agent.choose("English", language)
        yield from agent.click("radio", "dark")
        yield from agent.click("checkbox", "Newsletter")
        yield from agent.click("button", "Save")
        return "The settings are saved."
    if task.template == "info_fact":
        yield from agent.click("link", p["city"])
        headers = ["Population", "Founded", "Area"]
        header = headers[headers.index(p["fact"].capitalize()) - wrong]
        value = _number(agent.cell_after(header))
        return {"population": f"{p['city']} has {value:,} inhabitants.", "founded": f"It was founded in {value}.",
                "area": f"It covers {value} square kilometres."}[p["fact"]]
    if task.template == "info_table":
        yield from agent.click("link", "Rankings")
        rows: dict[str, int] = {}
        for _ in range(_SCROLLS):
            rows.update({r[0]: _number(r[1]) for r in agent.rows() if len(r) >= 2})
            if agent.find("link", "City guide") is not None:
                break
            agent.obs = yield "scroll", {"direction": "down", "amount": 0.8}
        ordered = sorted(rows, key=lambda name: -rows[name])
        rank = p["rank"] + wrong
        if rank > len(ordered):
            raise _Stuck("the table is shorter than the rank")
        return f"{ordered[rank - 1]}."
    if task.template == "multi_price":
        shop = _number((yield from agent.reach("text", "Price: $", exact=False)).name)
        yield from agent.click("link", "Compare prices")
        agent.obs = yield "switch_tab", {"tab_index": len(agent.obs.tabs) - 1}
        market = next((_number(r[1]) for r in agent.rows() if len(r) >= 2 and r[0] == p["product"]), None)
        if market is None:
            raise _Stuck(f"{p['product']} is not on the price watch")
        lower = (max if wrong else min)(shop, market)
        return f"The shop asks ${shop} and the price watch ${market}; the lower price is ${lower}."
    if task.template == "multi_city":
        first = _number(agent.cell_after("Population"))
        yield from agent.click("link", p["second"])
        agent.obs = yield "switch_tab", {"tab_index": len(agent.obs.tabs) - 1}
        second = _number(agent.cell_after("Population"))
        pick = (first > second) != wrong
        return f"{p['first'] if pick else p['second']} is larger."
    yield from agent.click("link", "Archive")
    yield from agent.click("link", f"{p['city']} city report, 1950")
    yield from agent.click("checkbox", "I am not a robot")
    yield from agent.click("button", "Verify")
    return "I could not get past the security check."


def attempt_kind(task: GUITask, attempt: int, *, seed: int = 0, failure_rate: float = DEFAULT_FAILURE_RATE) -> str:
    """``careful`` or one of `FAILURE_KINDS`, a function of (seed, task id, attempt)."""
    rng = random.Random(f"gui-teacher-{seed}-{task.id}-{attempt}")
    return rng.choice(FAILURE_KINDS) if rng.random() < failure_rate else "careful"


def _content(obs: Observation, images: bool) -> str | list[dict[str, Any]]:
    return obs.to_content() if images else obs.describe()


def teacher_episode(browser: BrowserSession, task: GUITask, *, attempt: int = 0, seed: int = 0,
                    failure_rate: float = DEFAULT_FAILURE_RATE, max_steps: int = 30,
                    images: bool = False) -> Trajectory:
    """One teacher attempt at `task` in `browser` (whose seed must be the task's site seed), checked and scored.

    The sites' state is reset first (`reset(..., fresh_state=True)`). The reward is `gui_reward` with every turn
    well formed and the checker standing in for the judge: 1.0 solved, 0.0 not, None (dropped) when blocked by
    the captcha. ``metadata`` holds the template, kind, attempt, teacher kind, ``blocked``, the check's reason and
    the final ``site_state`` (what the two-stage judge's reference block shows, `orchard.domains.gui.judge`).

    Args:
        browser: an open session with ``text_view`` observations (the teacher reads them).
        task: the task.
        attempt: the attempt's index (with `seed`, it draws the attempt's kind).
        seed: the noise's seed.
        failure_rate: the share of attempts that are failures, in [0, 1].
        max_steps: assistant turns before the episode is cut (``step_budget``); the paper's curriculum: 15, 30.
        images: observations as content parts with the screenshot (True) or as text only (False).
    """
    if not isinstance(task, GUITask):
        raise ValueError(f"task must be a GUITask, got {type(task).__name__}")
    if browser.seed != task.site_seed:
        raise ValueError(f"browser has site seed {browser.seed}, task {task.id} needs {task.site_seed}")
    if isinstance(failure_rate, bool) or not isinstance(failure_rate, int | float) or not 0 <= failure_rate <= 1:
        raise ValueError(f"failure_rate must be in [0, 1], got {failure_rate!r}")
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
    kind = attempt_kind(task, attempt, seed=seed, failure_rate=failure_rate)
    obs = browser.reset(BrowserSession.url(task.start_path), text_view=True, fresh_state=True)
    messages = [Message("system", GUI_SYSTEM), Message("user", f"{task.intent}\n\n{obs.describe()}")]
    if images and obs.screenshot:
        messages[1] = Message("user", [{"type": "text", "text": task.intent}, *obs.to_content()])
    agent = _Agent(obs)
    program = _program(task, agent, kind)
    response, reason, to_send = None, "step_budget", None
    for step in range(max_steps):
        if obs.env_error:
            reason = "env_error"
            break
        try:
            name, arguments = program.send(to_send) if step else next(program)
        except StopIteration as stop:
            name, arguments = "done", {"response": stop.value}
        except _Stuck:
            name, arguments = "done", {"response": "I could not finish the task."}
        call = ToolCall(name, arguments, id=f"call_{step}")
        messages.append(Message("assistant", None, tool_calls=[call]))
        if name == "done":
            response, reason = arguments["response"], "done"
            break
        obs = browser.step(name, arguments, text_view=True)
        messages.append(Message("tool", _content(obs, images), tool_call_id=call.id, name=name))
        to_send = agent.obs = obs
    program.close()
    metadata = {"template": task.template, "kind": task.kind, "attempt": attempt, "teacher_kind": kind,
                "blocked": False, "site_seed": task.site_seed}
    if reason == "env_error":
        metadata["env_error"] = obs.env_error
        return Trajectory(messages, GUI_TOOLS, None, task_id=task.id, termination_reason="env_error",
                          metadata=metadata)
    state = browser.site_state()
    check = check_task(task, response, state)
    steps = sum(m.role == "assistant" for m in messages)
    scored = gui_reward([True] * steps, check.success, ended_by_format_failure=False, page_blocked=check.blocked)
    metadata.update(blocked=check.blocked, check=check.reason, reward_reason=scored.reason, site_state=state)
    return Trajectory(messages, GUI_TOOLS, scored.reward, {"passed": float(check.success)}, task_id=task.id,
                      termination_reason=reason, metadata=metadata)


def teacher_trajectories(client: SandboxClient, tasks: Iterable[GUITask], *, attempts: int = ATTEMPTS_PER_TASK,
                         seed: int = 0, failure_rate: float = DEFAULT_FAILURE_RATE, max_steps: int = 30,
                         images: bool = False, **session_kwargs: Any) -> list[Trajectory]:
    """`attempts` teacher episodes per task (4, the paper's), failures kept, in task order.

    One browser (sandbox) per site seed serves its tasks one attempt at a time; each attempt's group id is the
    task's id. `session_kwargs` go to `BrowserSession.open` (e.g. ``image``, ``viewport``)."""
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be an int >= 1, got {attempts!r}")
    tasks = list(tasks)
    out: dict[tuple[str, int], Trajectory] = {}
    for site_seed in sorted({t.site_seed for t in tasks}):
        with BrowserSession.open(client, seed=site_seed, text_view=True, screenshots=images,
                                 **session_kwargs) as browser:
            for task in (t for t in tasks if t.site_seed == site_seed):
                for a in range(attempts):
                    trajectory = teacher_episode(browser, task, attempt=a, seed=seed, failure_rate=failure_rate,
                                                 max_steps=max_steps, images=images)
                    trajectory.group_id = task.id
                    out[task.id, a] = trajectory
    return [out[t.id, a] for t in tasks for a in range(attempts)]


__all__ = ["ATTEMPTS_PER_TASK", "DEFAULT_FAILURE_RATE", "FAILURE_KINDS", "GUI_SYSTEM", "Element", "attempt_kind",
           "parse_text_view", "teacher_episode", "teacher_trajectories"]
