"""Offline, seeded websites served inside a GUI sandbox: a shop, a form-heavy site, an information site, and the
distractors and the "captcha" page that real sites put in an agent's way.

Standard library only: this file is uploaded into the sandbox and run there by the browser host
(`orchard.domains.gui._host`), and imported on the trainer's side to build tasks from the same data.
Everything a site shows is a pure function of its seed (`shop_catalog(seed)`, `FORM_CHOICES`); everything a
visitor changes (cart, orders, bookings, settings) lives in one `SiteState` that the host reports on request,
never over HTTP, so an agent cannot read the answer key from a page.

Text that repeats what a visitor entered (a booking's name and date, the cart's quantities and the sums made from
them, a search's count) sits in an element marked ``data-entered``; form fields hold what the visitor typed in
their value. The browser host's text view flags the one and reports the other as a form control, so the judge
can tell what the site served from what an agent put into it (an answer typed into a page is not evidence).

Distractors: product and information pages carry a seeded banner ("You have won a prize...") that leads to a
promotion page with more such links and none back (only `go_back` returns). The captcha page is the paper's largest
environmental failure: it cannot be passed (every answer "fails"), and every time it is shown or answered
`SiteState.captcha_hits` counts it, so a run that met it is recognisable and can be removed from the loss.

Routes (answered in the sandbox by the browser context itself, `_host`; `serve_sites` serves them over HTTP for a
browser outside any sandbox):
    /shop/                  search (q), filters (category, color, max_price), sort (price_asc, price_desc, rating)
    /shop/product/<id>      a product page with an "Add to cart" form (quantity)
    /shop/cart              the cart, remove buttons, a checkout form
    /forms/                 links to the booking and settings forms
    /forms/booking          name, date (YYYY-MM-DD), guests (select), room (radio), breakfast (checkbox)
    /forms/settings         display name, language (select), newsletter (checkbox), theme (radio), font size
                            (a range slider, set by dragging)
    /info/                  the information site: city articles, rankings, price watch, archive
    /info/city/<slug>       a city's article: a paragraph, a fact table, related articles (open in a new tab)
    /info/rankings          every city in one table (city, population, area, founded), largest population first
    /info/prices            "price watch": market prices of some shop products (opens from a product page in a
                            new tab), for tasks that compare values across tabs
    /info/archive           archived reports; each report is behind the captcha
    /captcha                the security check (GET shows it, POST always fails)
    /promo/<n>              where the distractor banners lead
"""

from __future__ import annotations

import html
import json
import random
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

CATEGORIES = ("laptops", "phones", "headphones", "cameras", "watches")
COLORS = ("black", "silver", "blue", "red", "white")
_BRANDS = ("Acme", "Nimbus", "Vertex", "Orion", "Kestrel", "Lumen")
_MODELS = ("Air", "Pro", "Max", "Lite", "One", "Go", "Neo", "Ultra")
_PRICE_RANGE = {"laptops": (400, 2400), "phones": (150, 1300), "headphones": (20, 400), "cameras": (200, 2000),
                "watches": (50, 900)}
FORM_CHOICES = {
    "room": ("standard", "deluxe", "suite"),
    "guests": ("1", "2", "3", "4", "5", "6"),
    "language": ("English", "French", "German", "Spanish", "Japanese"),
    "theme": ("light", "dark"),
}
DEFAULT_SETTINGS = {"display_name": "guest", "language": "English", "newsletter": True, "theme": "light",
                    "font_size": 16}
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def shop_catalog(seed: int, n_products: int = 30) -> list[dict[str, Any]]:
    """The shop's products for `seed`: id, name, category, color, price (whole dollars), rating (one decimal).

    Names are unique and every (category, color) pair draws its own prices, so "the cheapest blue phone" has
    one answer; ties in price are broken by id everywhere (pages and tasks sort the same way)."""
    if isinstance(n_products, bool) or not isinstance(n_products, int) or n_products < 1:
        raise ValueError(f"n_products must be a positive int, got {n_products!r}")
    rng = random.Random(f"shop-{seed}")
    names = [f"{b} {m} {n}" for b in _BRANDS for m in _MODELS for n in range(2, 9)]
    rng.shuffle(names)
    products = []
    for i in range(n_products):
        category = CATEGORIES[i % len(CATEGORIES)]
        low, high = _PRICE_RANGE[category]
        products.append({"id": i + 1, "name": names[i], "category": category, "color": rng.choice(COLORS),
                         "price": rng.randint(low, high), "rating": round(rng.uniform(1.0, 5.0), 1)})
    return products


_CITY_HEADS = ("Bel", "Cor", "Dun", "Esk", "Fal", "Gor", "Hal", "Kel", "Lor", "Mar", "Nor", "Ost", "Pel", "Ros",
               "Sel", "Tor", "Ver", "Wen")
_CITY_TAILS = ("ford", "mouth", "by", "ton", "wick", "stead", "haven", "dale")
_RIVERS = ("Aln", "Brede", "Colne", "Derwent", "Esk", "Frome", "Lune", "Tamar")
BANNERS = ("You have won a prize! Claim it now", "Limited offer: 90% off everything today",
           "Your session is about to expire - click here", "Hot singles in your area")
"""The distractor banners' texts (seeded per page)."""


def info_cities(seed: int, n_cities: int = 12) -> list[dict[str, Any]]:
    """The information site's cities for `seed`: slug, name, population, founded (year), area (km2), river.

    Names, populations and areas are unique, so "the city with the third-largest population" has one answer.
    Each article also states a metropolitan population (`metro`, 1.2-1.8 x the city's): a plausible wrong
    answer next to the right one."""
    if isinstance(n_cities, bool) or not isinstance(n_cities, int) or not 2 <= n_cities <= 40:
        raise ValueError(f"n_cities must be an int in [2, 40], got {n_cities!r}")
    rng = random.Random(f"info-{seed}")
    names = rng.sample([h + t for h in _CITY_HEADS for t in _CITY_TAILS], n_cities)
    populations = rng.sample(range(20_000, 2_000_000, 1_000), n_cities)
    areas = rng.sample(range(30, 900), n_cities)
    return [{"slug": name.lower(), "name": name, "population": pop, "founded": rng.randint(1100, 1950),
             "area": area, "river": rng.choice(_RIVERS), "metro": int(pop * rng.uniform(1.2, 1.8)) // 1000 * 1000}
            for name, pop, area in zip(names, populations, areas, strict=True)]


def price_watch(seed: int) -> dict[int, int]:
    """Product id -> the market price the information site lists for it (10 of the shop's products).

    Each differs from the shop's price by 5 to 60 dollars, up or down, so "where is it cheaper" has one answer."""
    rng = random.Random(f"prices-{seed}")
    products = shop_catalog(seed)
    chosen = rng.sample(products, 10)
    return {p["id"]: max(1, p["price"] + rng.choice((-1, 1)) * rng.randint(5, 60)) for p in chosen}


@dataclass
class SiteState:
    """What visitors changed; read by the host's `state` request (thread-safe: one lock)."""

    cart: dict[int, int] = field(default_factory=dict)
    orders: list[dict[str, Any]] = field(default_factory=list)
    bookings: list[dict[str, Any]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_SETTINGS))
    captcha_hits: int = 0
    """How often the captcha page was shown or answered: > 0 means the run was blocked by it."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"cart": [{"id": k, "quantity": v} for k, v in sorted(self.cart.items())],
                    "orders": json.loads(json.dumps(self.orders)), "bookings": list(self.bookings),
                    "settings": dict(self.settings), "captcha_hits": self.captcha_hits}


_STYLE = ("body{font-family:sans-serif;margin:24px;font-size:16px}a{color:#1a4fd6}"
          "button,input[type=submit]{font-size:16px;padding:6px 14px;margin:4px}"
          "input,select{font-size:16px;margin:4px}table{border-collapse:collapse}"
          "td,th{border:1px solid #999;padding:4px 10px}.error{color:#b00020}.item{margin:6px 0}"
          ".help .tip{display:none}.help:hover .tip{display:inline}"
          ".banner{background:#ffe14d;padding:8px;font-weight:bold}")


def _page(title: str, body: str) -> bytes:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>{body}</body></html>").encode()


def _options(values: tuple[str, ...] | list[str], selected: str, blank: str | None = None) -> str:
    opts = [f"<option value=''>{html.escape(blank)}</option>"] if blank is not None else []
    opts += [f"<option value='{html.escape(v)}'{' selected' if v == selected else ''}>{html.escape(v)}</option>"
             for v in values]
    return "".join(opts)


class Sites:
    """The sites of one sandbox: the seeded data, the visitor state and the request handling."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.products = {p["id"]: p for p in shop_catalog(seed)}
        self.cities = {c["slug"]: c for c in info_cities(seed)}
        self.market = price_watch(seed)
        self.state = SiteState()

    def banner(self, page_key: str) -> str:
        """A distractor banner, the same for the same page and seed."""
        n = random.Random(f"banner-{self.seed}-{page_key}").randrange(len(BANNERS))
        return f"<p class='banner'><a href='/promo/{n}'>{BANNERS[n]}</a></p>"

    # -- shop ----------------------------------------------------------------------------------------------

    def shop_index(self, query: dict[str, str]) -> tuple[int, bytes]:
        q, category, color = query.get("q", "").strip().lower(), query.get("category", ""), query.get("color", "")
        try:
            max_price = int(query["max_price"]) if query.get("max_price") else None
        except ValueError:
            max_price = None
        rows = [p for p in self.products.values()
                if q in p["name"].lower() and (not category or p["category"] == category)
                and (not color or p["color"] == color) and (max_price is None or p["price"] <= max_price)]
        sort = query.get("sort", "")
        if sort == "price_asc":
            rows.sort(key=lambda p: (p["price"], p["id"]))
        elif sort == "price_desc":
            rows.sort(key=lambda p: (-p["price"], p["id"]))
        elif sort == "rating":
            rows.sort(key=lambda p: (-p["rating"], p["id"]))
        items = "".join(f"<li class='item'><a href='/shop/product/{p['id']}'>{html.escape(p['name'])}</a> "
                        f"- {p['category']}, {p['color']}, ${p['price']}, rating {p['rating']}</li>" for p in rows)
        sorts = (("", "relevance"), ("price_asc", "price: low to high"), ("price_desc", "price: high to low"),
                 ("rating", "rating"))
        sort_opts = "".join(f"<option value='{v}'{' selected' if v == sort else ''}>{label}</option>"
                            for v, label in sorts)
        form = (f"<form action='/shop/' method='get'><input name='q' placeholder='Search' "
                f"value='{html.escape(q)}'> <select name='category'>{_options(CATEGORIES, category, 'any category')}"
                f"</select> <select name='color'>{_options(COLORS, color, 'any color')}</select> "
                f"<input name='max_price' placeholder='max price' size='8' value='{max_price or ''}'> "
                f"<select name='sort'>{sort_opts}</select> <input type='submit' value='Search'></form>")
        cart_n = sum(self.state.cart.values())
        return 200, _page("Shop", f"<h1>Shop</h1><p><a href='/shop/cart' data-entered>Cart ({cart_n})</a></p>"
                                  f"<p class='help'>Help <span class='tip'>Free returns within 30 days</span></p>{form}"
                                  f"<p data-entered>{len(rows)} products</p><ul>{items}</ul>")

    def shop_product(self, product_id: int) -> tuple[int, bytes]:
        p = self.products.get(product_id)
        if p is None:
            return 404, _page("Not found", "<h1>Product not found</h1><a href='/shop/'>Back to the shop</a>")
        compare = ("<p><a href='/info/prices' target='_blank'>Compare prices</a></p>"
                   if product_id in self.market else "")
        return 200, _page(p["name"], f"<h1>{html.escape(p['name'])}</h1>{self.banner(f'product-{product_id}')}"
                                     f"<p>Category: {p['category']}</p>"
                                     f"<p>Color: {p['color']}</p><p>Price: ${p['price']}</p>"
                                     f"<p>Rating: {p['rating']}</p><form action='/shop/cart/add' method='post'>"
                                     f"<input type='hidden' name='id' value='{p['id']}'>Quantity "
                                     "<input name='quantity' value='1' size='3'> "
                                     f"<button type='submit'>Add to cart</button></form>{compare}"
                                     "<p><a href='/shop/'>Back to the shop</a> <a href='/shop/cart'>Cart</a></p>")

    def shop_cart(self, message: str = "") -> tuple[int, bytes]:
        with self.state.lock:
            cart = sorted(self.state.cart.items())
        rows = "".join(f"<tr><td>{html.escape(self.products[i]['name'])}</td><td data-entered>{n}</td>"
                       f"<td data-entered>${self.products[i]['price'] * n}</td><td><form action='/shop/cart/remove' "
                       f"method='post'><input type='hidden' name='id' value='{i}'><button>Remove</button>"
                       "</form></td></tr>" for i, n in cart)
        total = sum(self.products[i]["price"] * n for i, n in cart)
        checkout = ("<form action='/shop/checkout' method='post'><button type='submit'>Place order</button></form>"
                    if cart else "<p>Your cart is empty.</p>")
        return 200, _page("Cart", f"<h1>Cart</h1><p data-entered>{html.escape(message)}</p><table><tr><th>Product"
                                  f"</th><th>Quantity</th><th>Subtotal</th><th></th></tr>{rows}</table>"
                                  f"<p data-entered>Total: ${total}</p>{checkout}<p><a href='/shop/'>Continue shopping</a></p>")

    def shop_post(self, path: str, form: dict[str, str]) -> tuple[int, bytes]:
        if path == "/shop/checkout":
            with self.state.lock:
                if not self.state.cart:
                    return self.shop_cart("Nothing to order.")
                items = [{"id": i, "quantity": n} for i, n in sorted(self.state.cart.items())]
                self.state.orders.append({"items": items})
                self.state.cart.clear()
            return 200, _page("Order placed", "<h1>Thank you, your order was placed.</h1>"
                                              "<a href='/shop/'>Back to the shop</a>")
        try:
            product_id = int(form.get("id", ""))
        except ValueError:
            product_id = -1
        if product_id not in self.products:
            return 400, _page("Bad request", "<h1>Unknown product</h1>")
        if path == "/shop/cart/remove":
            with self.state.lock:
                self.state.cart.pop(product_id, None)
            return self.shop_cart("Removed.")
        try:
            quantity = int(form.get("quantity", "1"))
        except ValueError:
            quantity = 0
        if not 1 <= quantity <= 99:
            return self.shop_product(product_id)
        with self.state.lock:
            self.state.cart[product_id] = self.state.cart.get(product_id, 0) + quantity
        return self.shop_cart(f"Added {quantity} x {self.products[product_id]['name']}.")

    # -- forms ---------------------------------------------------------------------------------------------

    def forms_index(self) -> tuple[int, bytes]:
        return 200, _page("Forms", "<h1>Services</h1><p><a href='/forms/booking'>Book a room</a></p>"
                                   "<p><a href='/forms/settings'>Account settings</a></p>")

    def booking_page(self, error: str = "") -> tuple[int, bytes]:
        rooms = "".join(f"<label><input type='radio' name='room' value='{r}'{' checked' if i == 0 else ''}> {r}"
                        "</label> " for i, r in enumerate(FORM_CHOICES["room"]))
        return 200, _page("Book a room", f"<h1>Book a room</h1><p class='error'>{html.escape(error)}</p>"
                                         "<form action='/forms/booking' method='post'>"
                                         "<p>Name <input name='name'></p><p>Date <input name='date' "
                                         "placeholder='YYYY-MM-DD'></p><p>Guests <select name='guests'>"
                                         f"{_options(FORM_CHOICES['guests'], '1')}</select></p><p>Room {rooms}</p>"
                                         "<p><label><input type='checkbox' name='breakfast' value='yes'> "
                                         "Breakfast</label></p><p><button type='submit'>Book</button></p></form>")

    def booking_post(self, form: dict[str, str]) -> tuple[int, bytes]:
        name, date = form.get("name", "").strip(), form.get("date", "").strip()
        if not name:
            return self.booking_page("Please enter a name.")
        if not _DATE.match(date):
            return self.booking_page("Please enter the date as YYYY-MM-DD.")
        if form.get("guests") not in FORM_CHOICES["guests"] or form.get("room") not in FORM_CHOICES["room"]:
            return self.booking_page("Please choose the guests and the room.")
        booking = {"name": name, "date": date, "guests": int(form["guests"]), "room": form["room"],
                   "breakfast": form.get("breakfast") == "yes"}
        with self.state.lock:
            self.state.bookings.append(booking)
        return 200, _page("Booked", f"<h1>Booking confirmed</h1><p data-entered>{html.escape(name)}, {date}</p>"
                                    "<a href='/forms/'>Back</a>")

    def settings_page(self, message: str = "") -> tuple[int, bytes]:
        with self.state.lock:
            s = dict(self.state.settings)
        themes = "".join(f"<label><input type='radio' name='theme' value='{t}'"
                         f"{' checked' if t == s['theme'] else ''}> {t}</label> " for t in FORM_CHOICES["theme"])
        return 200, _page("Settings", f"<h1>Account settings</h1><p>{html.escape(message)}</p>"
                                      "<form action='/forms/settings' method='post'><p>Display name <input "
                                      f"name='display_name' value='{html.escape(s['display_name'])}'></p>"
                                      "<p>Language <select name='language'>"
                                      f"{_options(FORM_CHOICES['language'], s['language'])}</select></p>"
                                      "<p><label><input type='checkbox' name='newsletter' value='yes'"
                                      f"{' checked' if s['newsletter'] else ''}> Newsletter</label></p>"
                                      f"<p>Theme {themes}</p><p>Font size <input type='range' name='font_size' min='10' max='30' "
                                      f"value='{s['font_size']}'></p><p><button type='submit'>Save</button></p></form>")

    def settings_post(self, form: dict[str, str]) -> tuple[int, bytes]:
        name, font_size = form.get("display_name", "").strip(), form.get("font_size", "")
        if not name or form.get("language") not in FORM_CHOICES["language"] \
                or form.get("theme") not in FORM_CHOICES["theme"] or not font_size.isdigit() \
                or not 10 <= int(font_size) <= 30:
            return self.settings_page("Please fill in every field.")
        with self.state.lock:
            self.state.settings = {"display_name": name, "language": form["language"],
                                   "newsletter": form.get("newsletter") == "yes", "theme": form["theme"],
                                   "font_size": int(font_size)}
        return self.settings_page("Saved.")

    # -- information site, captcha, promotions ---------------------------------------------------------------

    def info_index(self) -> tuple[int, bytes]:
        links = "".join(f"<li><a href='/info/city/{c['slug']}'>{c['name']}</a></li>"
                        for c in sorted(self.cities.values(), key=lambda c: c["name"]))
        return 200, _page("City guide", f"<h1>City guide</h1>{self.banner('info')}<p><a href='/info/rankings'>"
                                        "Rankings</a> <a href='/info/prices'>Price watch</a> <a href='/info/archive'>"
                                        f"Archive</a></p><h2>Articles</h2><ul>{links}</ul>")

    def info_city(self, slug: str) -> tuple[int, bytes]:
        c = self.cities.get(slug)
        if c is None:
            return 404, _page("Not found", "<h1>Article not found</h1><a href='/info/'>City guide</a>")
        others = sorted(self.cities)
        i = others.index(slug)
        related = "".join(f"<li><a href='/info/city/{o}' target='_blank'>{self.cities[o]['name']}</a></li>"
                          for o in (others[(i + 1) % len(others)], others[(i + 5) % len(others)]))
        facts = (("Population", f"{c['population']:,}"), ("Founded", c["founded"]), ("Area", f"{c['area']} km2"),
                 ("River", c["river"]))
        rows = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in facts)
        return 200, _page(c["name"], f"<h1>{c['name']}</h1>{self.banner(f'city-{slug}')}<p>{c['name']} lies on "
                                     f"the river {c['river']}. Its metropolitan area is home to about "
                                     f"{c['metro']:,} people.</p><table>{rows}</table><h2>Related articles</h2>"
                                     f"<ul>{related}</ul><p><a href='/info/'>City guide</a></p>")

    def info_rankings(self) -> tuple[int, bytes]:
        rows = "".join(f"<tr><td>{c['name']}</td><td>{c['population']:,}</td><td>{c['area']}</td>"
                       f"<td>{c['founded']}</td></tr>"
                       for c in sorted(self.cities.values(), key=lambda c: -c["population"]))
        return 200, _page("Rankings", "<h1>Cities by population</h1><table><tr><th>City</th><th>Population</th>"
                                      f"<th>Area (km2)</th><th>Founded</th></tr>{rows}</table>"
                                      "<p><a href='/info/'>City guide</a></p>")

    def info_prices(self) -> tuple[int, bytes]:
        rows = "".join(f"<tr><td>{self.products[i]['name']}</td><td>${price}</td></tr>"
                       for i, price in sorted(self.market.items(), key=lambda kv: self.products[kv[0]]["name"]))
        return 200, _page("Price watch", f"<h1>Price watch</h1>{self.banner('prices')}<table><tr><th>Product</th>"
                                         f"<th>Market price</th></tr>{rows}</table>")

    def info_archive(self) -> tuple[int, bytes]:
        links = "".join(f"<li><a href='/info/archive/{slug}'>{c['name']} city report, 1950</a></li>"
                        for slug, c in sorted(self.cities.items()))
        return 200, _page("Archive", f"<h1>Archive</h1><ul>{links}</ul><p><a href='/info/'>City guide</a></p>")

    def captcha(self, failed: bool = False) -> tuple[int, bytes]:
        with self.state.lock:
            self.state.captcha_hits += 1
        message = "<p class='error'>Verification failed. Please try again.</p>" if failed else ""
        return 200, _page("Security check", "<h1>Security check</h1><p>Please confirm that you are a human to "
                                            f"continue.</p>{message}<form action='/captcha' method='post'><p><label>"
                                            "<input type='checkbox' name='human' value='yes'> I am not a robot"
                                            "</label></p><p><button type='submit'>Verify</button></p></form>")

    def promo(self, n: int) -> tuple[int, bytes]:
        links = "".join(f"<p class='banner'><a href='/promo/{(n + k) % len(BANNERS)}'>"
                        f"{BANNERS[(n + k) % len(BANNERS)]}</a></p>" for k in (1, 2))
        return 200, _page("Special offer", f"<h1>{BANNERS[n % len(BANNERS)]}</h1>{links}")

    # -- routing -------------------------------------------------------------------------------------------

    def handle(self, method: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
        """The status and HTML page for one request (`target` is the path with its query string)."""
        parts = urlsplit(target)
        path = parts.path
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        if method == "POST":
            form = {k: v[-1] for k, v in parse_qs(body.decode("utf-8", "replace")).items()}
            if path in ("/shop/cart/add", "/shop/cart/remove", "/shop/checkout"):
                return self.shop_post(path, form)
            if path == "/forms/booking":
                return self.booking_post(form)
            if path == "/forms/settings":
                return self.settings_post(form)
            if path == "/captcha":
                return self.captcha(failed=True)
        elif path in ("/", "/shop", "/shop/"):
            return self.shop_index(query)
        elif path.startswith("/shop/product/") and path.rsplit("/", 1)[1].isdigit():
            return self.shop_product(int(path.rsplit("/", 1)[1]))
        elif path == "/shop/cart":
            return self.shop_cart()
        elif path in ("/forms", "/forms/"):
            return self.forms_index()
        elif path == "/forms/booking":
            return self.booking_page()
        elif path == "/forms/settings":
            return self.settings_page()
        elif path in ("/info", "/info/"):
            return self.info_index()
        elif path.startswith("/info/city/"):
            return self.info_city(path[len("/info/city/"):])
        elif path == "/info/rankings":
            return self.info_rankings()
        elif path == "/info/prices":
            return self.info_prices()
        elif path == "/info/archive":
            return self.info_archive()
        elif path.startswith("/info/archive/") or path == "/captcha":
            return self.captcha()
        elif path.startswith("/promo/") and path.rsplit("/", 1)[1].isdigit():
            return self.promo(int(path.rsplit("/", 1)[1]))
        return 404, _page("Not found", "<h1>Page not found</h1><a href='/shop/'>Shop</a> <a href='/forms/'>Forms</a> "
                          "<a href='/info/'>City guide</a>")


def serve_sites(sites: Sites, port: int) -> ThreadingHTTPServer:
    """Serve `sites` on 127.0.0.1:`port` from a daemon thread; returns the server (`shutdown()` ends it). For a
    browser outside any sandbox (tests, the benchmark's raw Playwright): nothing in a sandbox listens."""

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, page: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def do_GET(self) -> None:
            self._reply(*sites.handle("GET", self.path))

        def do_POST(self) -> None:
            length = min(int(self.headers.get("Content-Length") or 0), 1 << 20)
            self._reply(*sites.handle("POST", self.path, self.rfile.read(length)))

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="sites").start()
    return server
