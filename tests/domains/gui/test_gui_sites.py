"""The seeded sites as request handling (no browser, no socket): data, filters, cart, forms, validation."""

import pytest

from orchard.domains.gui.sites import CATEGORIES, Sites, info_cities, shop_catalog


def test_the_catalog_is_a_function_of_the_seed():
    assert shop_catalog(3) == shop_catalog(3) and shop_catalog(3) != shop_catalog(4)
    products = shop_catalog(3)
    assert len({p["name"] for p in products}) == 30  # unique names: a task can name a product
    assert [p["category"] for p in products[:6]] == [*CATEGORIES, CATEGORIES[0]]
    with pytest.raises(ValueError, match="n_products must be a positive int, got 0"):
        shop_catalog(3, n_products=0)


def test_search_filters_and_sort():
    sites = Sites(5)
    phones = sorted((p for p in shop_catalog(5) if p["category"] == "phones"), key=lambda p: (p["price"], p["id"]))
    status, page = sites.handle("GET", "/shop/?category=phones&sort=price_asc")
    text = page.decode()
    assert status == 200 and f"{len(phones)} products" in text
    positions = [text.index(f">{p['name']}<") for p in phones]
    assert positions == sorted(positions)  # cheapest first
    cap = phones[1]["price"]
    assert f"{sum(p['price'] <= cap for p in phones)} products" in sites.handle(
        "GET", f"/shop/?category=phones&max_price={cap}")[1].decode()


def test_cart_checkout_and_forms_change_the_state():
    sites = Sites(0)
    sites.handle("POST", "/shop/cart/add", b"id=4&quantity=2")
    sites.handle("POST", "/shop/cart/add", b"id=4&quantity=1")
    assert sites.handle("POST", "/shop/cart/add", b"id=99&quantity=1")[0] == 400
    assert sites.state.snapshot()["cart"] == [{"id": 4, "quantity": 3}]  # 2 + 1
    sites.handle("POST", "/shop/checkout")
    assert sites.state.snapshot()["orders"] == [{"items": [{"id": 4, "quantity": 3}]}]
    _, page = sites.handle("POST", "/forms/booking", b"name=Ada&date=2026-05-01&guests=2&room=suite")
    assert b"Please enter the date" not in page
    _, page = sites.handle("POST", "/forms/booking", b"name=Ada&date=May+1&guests=2&room=suite")
    assert b"Please enter the date as YYYY-MM-DD." in page
    assert sites.state.snapshot()["bookings"] == [{"name": "Ada", "date": "2026-05-01", "guests": 2, "room": "suite",
                                                   "breakfast": False}]
    assert sites.handle("GET", "/nowhere")[0] == 404


def test_the_captcha_cannot_be_passed_and_is_counted():
    sites = Sites(0)
    _, page = sites.handle("GET", "/info/archive/anything")
    assert b"Security check" in page and sites.state.snapshot()["captcha_hits"] == 1
    _, page = sites.handle("POST", "/captcha", b"human=yes")  # the right box ticked: it still fails
    assert b"Verification failed" in page and sites.state.snapshot()["captcha_hits"] == 2  # 1 + 1


def test_distractor_banners_lead_away_with_no_way_back():
    sites = Sites(0)
    page = sites.handle("GET", "/info/")[1].decode()
    promo = page[page.index("/promo/"):].split("'")[0]
    status, target = sites.handle("GET", promo)
    assert status == 200 and b"/promo/" in target and b"/info/" not in target and b"/shop/" not in target
    assert sites.banner("info") == Sites(0).banner("info")  # seeded: the same page shows the same banner


def test_info_pages_show_the_seeded_facts():
    city = info_cities(2)[0]
    page = Sites(2).handle("GET", f"/info/city/{city['slug']}")[1].decode()
    assert f"<th>Population</th><td>{city['population']:,}</td>" in page
    assert f"{city['metro']:,}" in page  # the metropolitan figure: a plausible wrong answer beside the right one
    assert Sites(2).handle("GET", "/info/city/nowhere")[0] == 404
    with pytest.raises(ValueError, match="n_cities must be an int in"):
        info_cities(0, n_cities=1)
