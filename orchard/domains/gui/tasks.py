"""Seeded GUI tasks over the sandbox's sites: a start URL, a natural-language intent, and a checker.

A task is fully determined by (template, seed). Its site seed is ``seed // SITE_BLOCK``: the tasks of one split
block share one site (one browser session serves them all, reset between attempts with ``fresh_state``), and
the held-out split's sites are other sites than the train split's (other products, cities and prices).

Templates and their kinds:

========================  ==========  ============================================================  ==========
template                  kind        the intent                                                    checked on
========================  ==========  ============================================================  ==========
``shop_cart``             shop        add q of the cheapest <color> <category> item to the cart     cart
``shop_price``            shop        the price of the best-rated <category> item                   answer
``form_booking``          forms       book a room (name, date, guests, room, breakfast)             bookings
``form_settings``         forms       change the display name, language, theme, newsletter          settings
``info_fact``             info        a city's population, founding year or area                    answer
``info_table``            info        the city with the k-th largest population                     answer
``multi_price``           multi_tab   a product's lower price: the shop's or the price watch's      answer
                                      (the price watch opens in a new tab)
``multi_city``            multi_tab   which of two cities is larger (the second opens in a new tab)  answer
``captcha_report``        captcha     a figure from an archived report, which sits behind the       never
                                      captcha
========================  ==========  ============================================================  ==========

Answers are read from ``done(response)``: a number task passes when the response's last number (thousands
separators and a leading ``$`` allowed) is the answer; a name task when the response names exactly one of the
candidates and it is the answer. State tasks compare `BrowserSession.site_state()` with what the task asks. A run
of a ``captcha`` task whose site state counts captcha hits is *blocked* (`TaskCheck.blocked`): the task led it
into the captcha, the environment failed it, not the policy, and the loss leaves it out
(`orchard.rewards.gui_reward`'s ``page_blocked``). Any other task's run that met the captcha went there on its
own: a failure, never blocked (else a detour would take a failing run out of the loss and out of evaluation).
An answer task also names its *evidence* (`GUITask.evidence`): the numbers that a page must have shown for the
answer to be read from it, which the judge checks against the text the site served. How an intent is worded and
what counts as an answer are our choices; the paper names the kinds of sites and the captcha failure only.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from orchard.domains._splits import split_plan
from orchard.domains.gui.sites import CATEGORIES, FORM_CHOICES, info_cities, price_watch, shop_catalog

TEMPLATES = {
    "shop_cart": "shop",
    "shop_price": "shop",
    "form_booking": "forms",
    "form_settings": "forms",
    "info_fact": "info",
    "info_table": "info",
    "multi_price": "multi_tab",
    "multi_city": "multi_tab",
    "captcha_report": "captcha",
}
"""Template name -> kind (shop, forms, info, multi_tab, captcha)."""

HELDOUT_SEED_OFFSET = 1_000_000
"""Held-out tasks use seeds from here on; train tasks use seeds below it."""

SITE_BLOCK = 10_000
"""Tasks whose seeds share ``seed // SITE_BLOCK`` share a site seed (one split block, one site)."""

_FIRST = ("Ada", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas")
_LAST = ("Novak", "Okafor", "Silva", "Tanaka", "Weber", "Young")
# a number standing alone: "$1,200" and "1200." count, the 2 of "km2" does not
_NUMBER = re.compile(r"(?<![\w.])\$?(\d[\d,]*(?:\.\d+)?)(?!\w)")


@dataclass(frozen=True)
class GUITask:
    """One task: where it starts, what the user asks, and what the checker accepts (never shown to the agent)."""

    id: str
    template: str
    seed: int
    site_seed: int
    """The `BrowserSession` seed whose sites this task is about."""
    start_path: str
    """The start page's path on the sandbox's site server (`BrowserSession.url(start_path)`)."""
    intent: str
    answer: str | None = None
    """The expected answer of an answer task (a number or a name); None for a state task."""
    choices: tuple[str, ...] = ()
    """The candidate names of a name answer (the response must name exactly one)."""
    expected_state: dict[str, Any] | None = None
    """What `site_state()` must hold for a state task: ``{"cart": [...]}``, ``{"booking": {...}}`` (one booking,
    exactly this) or ``{"settings": {...}}`` (these fields)."""
    params: dict[str, Any] = field(default_factory=dict)
    """The task's hidden parameters (the product, city, field...); the scripted teacher's privilege."""
    evidence: tuple[str, ...] = ()
    """The numbers (digits only, no separators) that the pages a run saw must have shown for its answer to be read
    from them, not recalled: the answer itself; both prices or both populations compared; the populations ranked
    above and at the asked rank. Empty: the answer itself when it is a number, nothing for a name or a state."""

    @property
    def kind(self) -> str:
        """shop, forms, info, multi_tab or captcha."""
        return TEMPLATES[self.template]


@dataclass(frozen=True)
class TaskCheck:
    """A checked run: `success`; `blocked` when the captcha stopped it (drop it, never score it); `reason`."""

    success: bool
    blocked: bool
    reason: str


def _singular(category: str) -> str:
    return {"watches": "watch", "headphones": "pair of headphones"}.get(category, category.rstrip("s"))


def make_task(template: str, seed: int) -> GUITask:
    """The task of `template` for `seed` (a non-negative int); the same pair always gives the same task."""
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {sorted(TEMPLATES)}, got {template!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    site_seed = seed // SITE_BLOCK
    rng = random.Random(f"gui-{template}-{seed}")
    products, cities = shop_catalog(site_seed), info_cities(site_seed)
    task_id = f"gui-{template}-{seed}"
    if template == "shop_cart":
        pairs = sorted({(p["category"], p["color"]) for p in products})
        category, color = rng.choice(pairs)
        target = min((p for p in products if p["category"] == category and p["color"] == color),
                     key=lambda p: (p["price"], p["id"]))
        quantity = rng.randint(1, 3)
        return GUITask(task_id, template, seed, site_seed, "/shop/",
                       f"Add {quantity} of the cheapest {color} {_singular(category)} to the shopping cart.",
                       expected_state={"cart": [{"id": target["id"], "quantity": quantity}]},
                       params={"category": category, "color": color, "product": target["name"],
                               "quantity": quantity})
    if template == "shop_price":
        category = rng.choice(CATEGORIES)
        target = min((p for p in products if p["category"] == category), key=lambda p: (-p["rating"], p["id"]))
        return GUITask(task_id, template, seed, site_seed, "/shop/",
                       f"What is the price, in dollars, of the best-rated {_singular(category)} in the shop? "
                       "(If several share the best rating, the one listed first.)", answer=str(target["price"]),
                       params={"category": category, "product": target["name"]}, evidence=(str(target["price"]),))
    if template == "form_booking":
        booking = {"name": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
                   "date": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                   "guests": rng.randint(1, 6), "room": rng.choice(FORM_CHOICES["room"]),
                   "breakfast": rng.random() < 0.5}
        extra = "with breakfast" if booking["breakfast"] else "without breakfast"
        return GUITask(task_id, template, seed, site_seed, "/forms/",
                       f"Book a {booking['room']} room for {booking['guests']} guest(s) on {booking['date']} "
                       f"under the name {booking['name']}, {extra}.", expected_state={"booking": booking},
                       params=dict(booking))
    if template == "form_settings":
        settings = {"display_name": f"{rng.choice(_FIRST).lower()}{rng.randint(10, 99)}",
                    "language": rng.choice(FORM_CHOICES["language"][1:]), "theme": "dark",
                    "newsletter": False}
        return GUITask(task_id, template, seed, site_seed, "/forms/settings",
                       f"In the account settings, change the display name to {settings['display_name']}, the "
                       f"language to {settings['language']} and the theme to dark, unsubscribe from the "
                       "newsletter, and save.", expected_state={"settings": settings}, params=dict(settings))
    if template == "info_fact":
        city = rng.choice(cities)
        fact = rng.choice(("population", "founded", "area"))
        question = {"population": f"How many people live in the city of {city['name']}?",
                    "founded": f"In which year was {city['name']} founded?",
                    "area": f"What is the area of {city['name']} in square kilometres?"}[fact]
        return GUITask(task_id, template, seed, site_seed, "/info/", f"Using the city guide: {question}",
                       answer=str(city[fact]), params={"city": city["name"], "fact": fact},
                       evidence=(str(city[fact]),))
    if template == "info_table":
        rank = rng.randint(2, 5)
        ordered = sorted(cities, key=lambda c: -c["population"])
        nth = {2: "second", 3: "third", 4: "fourth", 5: "fifth"}[rank]
        return GUITask(task_id, template, seed, site_seed, "/info/",
                       f"Using the city guide, which city has the {nth}-largest population?",
                       answer=ordered[rank - 1]["name"], choices=tuple(c["name"] for c in cities),
                       params={"rank": rank},
                       # the k-th of a ranking is read from the k largest populations (the top of the rankings)
                       evidence=tuple(str(c["population"]) for c in ordered[:rank]))
    if template == "multi_price":
        market = price_watch(site_seed)
        product_id = rng.choice(sorted(market))
        product = next(p for p in products if p["id"] == product_id)
        return GUITask(task_id, template, seed, site_seed, f"/shop/product/{product_id}",
                       f"Is the {product['name']} cheaper in this shop or on the price watch list (use the "
                       "'Compare prices' link)? Answer with the lower of the two prices in dollars.",
                       answer=str(min(product["price"], market[product_id])),
                       params={"product": product["name"], "shop_price": product["price"],
                               "market_price": market[product_id]},
                       evidence=(str(product["price"]), str(market[product_id])))
    if template == "multi_city":
        slugs = sorted(c["slug"] for c in cities)
        first = rng.randrange(len(slugs))
        # the article of slugs[i] links (in a new tab) to slugs[i + 1] and slugs[i + 5]
        other = slugs[(first + rng.choice((1, 5))) % len(slugs)]
        a, b = (next(c for c in cities if c["slug"] == s) for s in (slugs[first], other))
        return GUITask(task_id, template, seed, site_seed, f"/info/city/{a['slug']}",
                       f"Which city has the larger population, {a['name']} or {b['name']} (its article is linked "
                       "from this one)? Answer with the city's name.",
                       answer=max((a, b), key=lambda c: c["population"])["name"], choices=(a["name"], b["name"]),
                       params={"first": a["name"], "second": b["name"]},
                       evidence=(str(a["population"]), str(b["population"])))
    city = rng.choice(cities)
    return GUITask(task_id, template, seed, site_seed, "/info/",
                   f"The city guide's archive has a 1950 city report on {city['name']}. How many bridges does "
                   "the report list?", params={"city": city["name"]})


def split_tasks(split: str, n_per_template: int, *, seed: int = 0, templates: tuple[str, ...] | None = None,
                heldout_templates: tuple[str, ...] = ()) -> list[GUITask]:
    """Tasks of one split, `n_per_template` of each template, in template order.

    Train tasks draw seeds in [0, HELDOUT_SEED_OFFSET), held-out tasks from HELDOUT_SEED_OFFSET on (other sites
    too, see SITE_BLOCK), so the two never share a task. ``heldout_templates`` appear only in "heldout".

    Args:
        split: "train" or "heldout".
        n_per_template: tasks per template, in [0, SITE_BLOCK].
        seed: which block of seeds (and so which site) to draw; different seeds give disjoint task sets.
        templates: the templates to use (default all).
        heldout_templates: templates excluded from "train".
    """
    if isinstance(n_per_template, bool) or not isinstance(n_per_template, int) \
            or not 0 <= n_per_template <= SITE_BLOCK:
        raise ValueError(f"n_per_template must be an int in [0, {SITE_BLOCK}], got {n_per_template!r}")
    names, base = split_plan(split, known=TEMPLATES, templates=templates, heldout_templates=heldout_templates,
                             seed=seed, heldout_offset=HELDOUT_SEED_OFFSET)
    if split == "train" and base + n_per_template > HELDOUT_SEED_OFFSET:
        raise ValueError(f"seed {seed} with n_per_template {n_per_template} overflows the train seed range")
    return [make_task(t, base + i) for t in names for i in range(n_per_template)]


def _last_number(response: str) -> str | None:
    numbers = _NUMBER.findall(response)
    if not numbers:
        return None
    value = numbers[-1].replace(",", "").rstrip(",")
    return value[:-2] if value.endswith(".0") else value


def check_task(task: GUITask, response: str | None, state: dict[str, Any]) -> TaskCheck:
    """Whether a run solved `task`, from its `done` response (None: it never called done) and the site state.

    A run that met the captcha (``state["captcha_hits"] > 0``) is never a success: blocked when the task leads
    through the captcha (its kind is ``captcha``), a plain failure when the agent went there on its own."""
    if not isinstance(task, GUITask):
        raise ValueError(f"task must be a GUITask, got {type(task).__name__}")
    if response is not None and not isinstance(response, str):
        raise ValueError(f"response must be a str or None, got {type(response).__name__}")
    if not isinstance(state, dict):
        raise ValueError(f"state must be a site_state() dict, got {type(state).__name__}")
    if state.get("captcha_hits", 0) > 0:
        if task.kind == "captcha":
            return TaskCheck(False, True, "blocked by the captcha")
        return TaskCheck(False, False, "left the task for the captcha page")
    if task.answer is not None:
        if response is None:
            return TaskCheck(False, False, "no answer (done was never called)")
        if task.choices:
            lowered = response.lower()
            named = [c for c in task.choices if re.search(rf"\b{re.escape(c.lower())}\b", lowered)]
            ok = named == [task.answer]
            return TaskCheck(ok, False, "right name" if ok else f"named {named}, expected {task.answer!r}")
        got = _last_number(response)
        ok = got == task.answer
        return TaskCheck(ok, False, "right number" if ok else f"answered {got}, expected {task.answer}")
    expected = task.expected_state
    if expected is None:
        return TaskCheck(False, False, "the task cannot be completed (its page is behind the captcha)")
    if "cart" in expected:
        ok = state.get("cart") == expected["cart"]
        return TaskCheck(ok, False, "cart as asked" if ok else f"cart {state.get('cart')}, expected {expected['cart']}")
    if "booking" in expected:
        ok = state.get("bookings") == [expected["booking"]]
        return TaskCheck(ok, False, "booked as asked" if ok else f"bookings {state.get('bookings')}")
    settings = state.get("settings") or {}
    wrong = {k: settings.get(k) for k, v in expected["settings"].items() if settings.get(k) != v}
    return TaskCheck(not wrong, False, "settings as asked" if not wrong else f"settings differ: {wrong}")


__all__ = ["HELDOUT_SEED_OFFSET", "SITE_BLOCK", "TEMPLATES", "GUITask", "TaskCheck", "check_task", "make_task",
           "split_tasks"]
