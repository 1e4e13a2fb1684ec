"""The task list and its checker (no browser): determinism, splits, validation, and hand-made answers and states."""

import pytest

from orchard.domains.gui.sites import Sites, info_cities, price_watch, shop_catalog
from orchard.domains.gui.tasks import (
    HELDOUT_SEED_OFFSET,
    SITE_BLOCK,
    TEMPLATES,
    GUITask,
    check_task,
    make_task,
    split_tasks,
)

STATE = {"cart": [], "orders": [], "bookings": [], "settings": {}, "captcha_hits": 0}


def test_tasks_are_functions_of_template_and_seed_and_splits_are_disjoint():
    assert make_task("info_fact", 7) == make_task("info_fact", 7) != make_task("info_fact", 8)
    train, heldout = split_tasks("train", 3), split_tasks("heldout", 3)
    assert len(train) == len(heldout) == 3 * len(TEMPLATES)  # 9 templates x 3
    assert not {t.id for t in train} & {t.id for t in heldout}
    # one site per split block: seeds 0-2 -> site 0; held-out seeds 1,000,000+ -> site 1,000,000 // 10,000 = 100
    assert {t.site_seed for t in train} == {0} and {t.site_seed for t in heldout} == {HELDOUT_SEED_OFFSET // SITE_BLOCK}
    assert {t.site_seed for t in split_tasks("train", 1, seed=2)} == {2}
    assert {t.kind for t in train} == {"shop", "forms", "info", "multi_tab", "captcha"}
    assert [t.template for t in split_tasks("train", 1, heldout_templates=("captcha_report",))][-1] == "multi_city"


def test_answers_come_from_the_sites_data():
    task = make_task("multi_price", 5)
    product = next(p for p in shop_catalog(0) if p["name"] == task.params["product"])
    assert task.answer == str(min(product["price"], price_watch(0)[product["id"]]))
    assert task.start_path == f"/shop/product/{product['id']}"
    task = make_task("info_table", 3)
    by_population = sorted(info_cities(0), key=lambda c: -c["population"])
    assert task.answer == by_population[task.params["rank"] - 1]["name"]
    # the rankings page lists the same order
    page = Sites(0).handle("GET", "/info/rankings")[1].decode()
    assert [page.index(f"<td>{c['name']}</td>") for c in by_population] == sorted(
        page.index(f"<td>{c['name']}</td>") for c in by_population)


def test_validation_names_the_argument():
    with pytest.raises(ValueError, match="template must be one of"):
        make_task("fly", 0)
    with pytest.raises(ValueError, match="seed must be a non-negative int, got -1"):
        make_task("shop_cart", -1)
    with pytest.raises(ValueError, match="n_per_template must be an int in"):
        split_tasks("train", -1)
    with pytest.raises(ValueError, match="split must be 'train' or 'heldout'"):
        split_tasks("test", 1)
    with pytest.raises(ValueError, match="state must be a site_state"):
        check_task(make_task("shop_cart", 0), "x", None)


def test_number_answers_are_the_last_standalone_number():
    task = GUITask("t", "info_fact", 0, 0, "/info/", "area?", answer="720")
    assert check_task(task, "It covers 720 km2.", STATE).success  # the 2 of km2 is not a number
    assert check_task(task, "720", STATE).success
    assert not check_task(task, "720 or 721", STATE).success  # the last number counts: 721
    assert check_task(task, "about 1,720", STATE).reason == "answered 1720, expected 720"
    assert check_task(task, None, STATE).reason == "no answer (done was never called)"
    money = GUITask("t", "multi_price", 0, 0, "/", "price?", answer="271")
    assert check_task(money, "Shop $329, watch $271; lower: $271.", STATE).success


def test_name_answers_name_exactly_one_candidate():
    task = GUITask("t", "multi_city", 0, 0, "/", "which?", answer="Tormouth", choices=("Torhaven", "Tormouth"))
    assert check_task(task, "tormouth is larger", STATE).success
    assert not check_task(task, "Torhaven is larger", STATE).success
    assert not check_task(task, "Tormouth, or maybe Torhaven", STATE).success  # both named: no answer


def test_state_tasks_and_the_captcha_flag():
    cart = make_task("shop_cart", 0)
    want = cart.expected_state["cart"]
    assert check_task(cart, "", {**STATE, "cart": want}).success
    assert not check_task(cart, "", {**STATE, "cart": [{**want[0], "quantity": want[0]["quantity"] + 1}]}).success
    booking = make_task("form_booking", 0)
    b = booking.expected_state["booking"]
    assert check_task(booking, "", {**STATE, "bookings": [b]}).success
    assert not check_task(booking, "", {**STATE, "bookings": [b, b]}).success  # booked twice
    captcha = make_task("captcha_report", 0)
    unpassable = check_task(captcha, "12", STATE)  # its page is behind the captcha: no answer is right
    assert not unpassable.success and not unpassable.blocked
    assert check_task(captcha, "12", {**STATE, "captcha_hits": 1}).blocked  # its way led into the captcha
    # any other task's run that met the captcha went there on its own: a failure, even with the right answer,
    # and never blocked (a blocked run leaves the loss and the evaluation)
    fact = make_task("info_fact", 0)
    detour = check_task(fact, fact.answer, {**STATE, "captcha_hits": 1})
    assert not detour.success and not detour.blocked
