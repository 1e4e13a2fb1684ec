"""The seeded sites as request handling (no browser, no socket): data, filters, cart, forms, validation, and the
marks on text that repeats what a visitor entered."""

import re
from html.parser import HTMLParser

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


class _ServedText(HTMLParser):
    """A page's text nodes outside the elements the site marks ``data-entered`` (text that repeats what the
    visitor entered); attribute values, a text field's value among them, are never text nodes."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self) -> None:
        super().__init__()
        self.open: list[tuple[str, bool]] = []
        self.parts: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.open.append((tag, any(k == "data-entered" for k, _ in attrs)))

    def handle_endtag(self, tag):
        while self.open and self.open.pop()[0] != tag:
            pass

    def handle_data(self, data):
        if not any(entered for _, entered in self.open):
            self.parts.append(data)


def served_text(page: bytes) -> str:
    parser = _ServedText()
    parser.feed(page.decode())
    return " ".join(parser.parts)


def test_text_that_repeats_what_the_visitor_entered_is_marked():
    # what a visitor can type or pick reaches a page only inside a marked element: an agent that types the answer
    # into the site cannot have the site serve it back as the site's own text
    marker = "Qzv 4242917"
    sites = Sites(0)
    quoted = marker.replace(" ", "+")
    pages = [sites.handle("GET", f"/shop/?q={quoted}"), sites.handle("GET", "/shop/?max_price=4242917"),
             sites.handle("GET", f"/shop/?category={quoted}&color={quoted}&sort={quoted}"),
             sites.handle("GET", f"/info/city/{quoted}"), sites.handle("GET", "/shop/product/4242917"),
             sites.handle("GET", f"/{quoted}"), sites.handle("GET", "/promo/4242917"),
             sites.handle("POST", "/forms/booking", f"name={quoted}&date=2026-01-02&guests=2&room=suite".encode()),
             sites.handle("POST", "/forms/booking", f"name={quoted}&date={quoted}&guests=2&room=suite".encode()),
             sites.handle("POST", "/forms/settings", f"display_name={quoted}&language=French&theme=dark&"
                                                     "font_size=12".encode()),
             sites.handle("POST", "/shop/cart/add", f"id={quoted}&quantity=1".encode()),
             sites.handle("POST", "/shop/cart/add", f"id=4&quantity={quoted}".encode())]
    assert sites.state.snapshot()["bookings"][0]["name"] == marker  # the booking went through
    for _, page in pages:
        assert marker not in served_text(page) and "4242917" not in served_text(page), page
    # numbers made from what the visitor chose (quantities, the sums they make, a search's count) are marked
    # too: the unmarked text of the cart and the shop is the same whatever the quantity
    seen = []
    for quantity in (2, 37):
        sites = Sites(0)
        added = sites.handle("POST", "/shop/cart/add", f"id=4&quantity={quantity}".encode())[1]
        seen.append([served_text(p) for p in (added, sites.handle("GET", "/shop/cart")[1],
                                              sites.handle("GET", "/shop/")[1])])
    assert seen[0] == seen[1]
    assert re.search(r"\d+ products", served_text(Sites(0).handle("GET", "/shop/?max_price=300")[1])) is None
