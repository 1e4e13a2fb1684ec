"""The repository templates of the toy SWE generator: six small Python packages and their pytest suites.

Each template is a package of three modules and a suite of `Case`s, one test function each, grouped in one test
file per module. A case is a snippet a user could run (``setup`` lines, then the ``call`` expression) and the
value it should give (``expected``, a Python literal, or ``raises <Error>``), so the generator can both write the
test and, from running the snippet on the buggy code, the issue a user would file.

The code is loop-bounded by construction (``for`` over finite data, no ``while``), so no mutation can make a
test hang; the generator still runs everything under a timeout.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    """One test: ``def test_<name>(): <setup>; assert <call> == <expected>`` in the test file of ``module``."""

    module: str
    """The module (``pkg/mod.py``) whose test file holds the case."""
    name: str
    """The test function's name without ``test_``."""
    setup: str
    """Statements before the call, one per line (may be empty)."""
    call: str
    """The expression under test."""
    expected: str
    """A Python literal, or ``raises <ExceptionName>``."""

    @property
    def raises(self) -> str | None:
        """The exception the call must raise, or None when it must return ``expected``."""
        return self.expected.split(None, 1)[1] if self.expected.startswith("raises ") else None


@dataclass(frozen=True)
class RepoTemplate:
    """One toy repository: its modules, the import line of each module's tests, and its cases."""

    name: str
    package: str
    description: str
    modules: dict[str, str]
    """Module path (``pkg/mod.py``) -> source."""
    imports: dict[str, str]
    """Module path -> the import line its test file (and an issue's snippet) starts with."""
    cases: tuple[Case, ...]

    def test_path(self, module: str) -> str:
        """The test file of ``module``: ``tests/test_<stem>.py``."""
        return f"tests/test_{module.rsplit('/', 1)[-1]}"

    def test_id(self, case: Case) -> str:
        """The pytest node id of ``case``."""
        return f"{self.test_path(case.module)}::test_{case.name}"


def _cases(module: str, rows: list[tuple[str, str, str, str]]) -> list[Case]:
    return [Case(module, name, setup, call, expected) for name, setup, call, expected in rows]


INVENTORY = RepoTemplate(
    name="inventory",
    package="inventory",
    description="Track items in a warehouse: stock levels, values and reorder reports.",
    modules={
        "inventory/__init__.py": '"""Warehouse inventory."""\n',
        "inventory/items.py": '''"""Items and their value."""


class Item:
    def __init__(self, name, price, qty=0):
        if price < 0:
            raise ValueError("price must be >= 0")
        self.name = name
        self.price = price
        self.qty = qty

    def value(self):
        return self.price * self.qty


def total_value(items):
    total = 0
    for item in items:
        total += item.value()
    return total


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best.name if best is not None else None
''',
        "inventory/stock.py": '''"""Stock levels."""

from inventory.items import Item


class Stock:
    def __init__(self):
        self.items = {}

    def add(self, name, price, qty=1):
        if name in self.items:
            self.items[name].qty += qty
        else:
            self.items[name] = Item(name, price, qty)

    def remove(self, name, qty=1):
        item = self.items[name]
        if qty > item.qty:
            raise ValueError("not enough " + name)
        item.qty -= qty
        if item.qty == 0:
            del self.items[name]

    def count(self, name):
        if name not in self.items:
            return 0
        return self.items[name].qty

    def low_stock(self, threshold=5):
        return sorted(name for name, item in self.items.items() if item.qty < threshold)
''',
        "inventory/report.py": '''"""Reports over a stock."""

from inventory.items import total_value


def summary(stock):
    items = list(stock.items.values())
    units = 0
    for item in items:
        units += item.qty
    return {"lines": len(items), "units": units, "value": total_value(items)}


def top_items(stock, n=3):
    ranked = sorted(stock.items.values(), key=lambda item: item.value(), reverse=True)
    return [item.name for item in ranked[:n]]


def reorder_list(stock, threshold=5, target=10):
    orders = {}
    for name in stock.low_stock(threshold):
        orders[name] = target - stock.count(name)
    return orders
''',
    },
    imports={
        "inventory/items.py": "from inventory.items import Item, cheapest, total_value",
        "inventory/stock.py": "from inventory.stock import Stock",
        "inventory/report.py": "from inventory.report import reorder_list, summary, top_items\n"
                               "from inventory.stock import Stock",
    },
    cases=tuple(
        _cases("inventory/items.py", [
            ("item_value", "", "Item('bolt', 3, 4).value()", "12"),
            ("total_value", "", "total_value([Item('a', 2, 5), Item('b', 1, 3)])", "13"),
            ("total_value_empty", "", "total_value([])", "0"),
            ("cheapest", "", "cheapest([Item('a', 5), Item('b', 2), Item('c', 9)])", "'b'"),
            ("negative_price", "", "Item('x', -1)", "raises ValueError"),
        ]) + _cases("inventory/stock.py", [
            ("add_twice", "s = Stock()\ns.add('nut', 1, 2)\ns.add('nut', 1, 3)", "s.count('nut')", "5"),
            ("remove_some", "s = Stock()\ns.add('nut', 1, 4)\ns.remove('nut', 3)", "s.count('nut')", "1"),
            ("remove_all", "s = Stock()\ns.add('nut', 1, 2)\ns.remove('nut', 2)", "'nut' in s.items", "False"),
            ("remove_too_many", "s = Stock()\ns.add('nut', 1, 2)", "s.remove('nut', 3)", "raises ValueError"),
            ("low_stock", "s = Stock()\ns.add('a', 1, 5)\ns.add('b', 1, 4)\ns.add('c', 1, 9)", "s.low_stock()",
             "['b']"),
            ("count_missing", "s = Stock()", "s.count('gear')", "0"),
        ]) + _cases("inventory/report.py", [
            ("summary", "s = Stock()\ns.add('a', 2, 3)\ns.add('b', 5, 1)", "summary(s)",
             "{'lines': 2, 'units': 4, 'value': 11}"),
            ("top_items", "s = Stock()\ns.add('a', 1, 1)\ns.add('b', 4, 2)\ns.add('c', 2, 2)",
             "top_items(s, 2)", "['b', 'c']"),
            ("reorder", "s = Stock()\ns.add('a', 1, 2)\ns.add('b', 1, 7)", "reorder_list(s, 5, 10)", "{'a': 8}"),
        ])),
)

TEXTUTIL = RepoTemplate(
    name="textutil",
    package="textutil",
    description="Small text helpers: word statistics, wrapping and slugs.",
    modules={
        "textutil/__init__.py": '"""Text helpers."""\n',
        "textutil/words.py": '''"""Word statistics."""


def words(text):
    return [w for w in text.split() if w]


def word_count(text):
    return len(words(text))


def longest_word(text):
    best = ""
    for word in words(text):
        if len(word) > len(best):
            best = word
    return best


def is_palindrome(text):
    letters = [c.lower() for c in text if c.isalnum()]
    return letters == letters[::-1]


def frequencies(text):
    counts = {}
    for word in words(text.lower()):
        counts[word] = counts.get(word, 0) + 1
    return counts
''',
        "textutil/wrap.py": '''"""Line wrapping."""

from textutil.words import words


def wrap(text, width=20):
    lines = []
    current = ""
    for word in words(text):
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = word
        elif current:
            current = current + " " + word
        else:
            current = word
    if current:
        lines.append(current)
    return lines


def indent(lines, spaces=2):
    return [" " * spaces + line for line in lines]
''',
        "textutil/slug.py": '''"""Slugs and truncation."""


def slugify(text, sep="-"):
    parts = []
    for word in text.lower().split():
        cleaned = "".join(c for c in word if c.isalnum())
        if cleaned:
            parts.append(cleaned)
    return sep.join(parts)


def truncate(text, limit, suffix="..."):
    if len(text) <= limit:
        return text
    return text[: limit - len(suffix)] + suffix


def initials(name):
    return "".join(part[0].upper() for part in name.split())
''',
    },
    imports={
        "textutil/words.py": "from textutil.words import frequencies, is_palindrome, longest_word, word_count",
        "textutil/wrap.py": "from textutil.wrap import indent, wrap",
        "textutil/slug.py": "from textutil.slug import initials, slugify, truncate",
    },
    cases=tuple(
        _cases("textutil/words.py", [
            ("word_count", "", "word_count('the quick  brown fox')", "4"),
            ("longest_word", "", "longest_word('a bb ccc dd')", "'ccc'"),
            ("longest_first_wins", "", "longest_word('ab cd')", "'ab'"),
            ("palindrome", "", "is_palindrome('Never odd or even')", "True"),
            ("not_palindrome", "", "is_palindrome('abca')", "False"),
            ("frequencies", "", "frequencies('a b A c b a')", "{'a': 3, 'b': 2, 'c': 1}"),
        ]) + _cases("textutil/wrap.py", [
            ("wrap", "", "wrap('one two three four', 9)", "['one two', 'three', 'four']"),
            ("wrap_exact_width", "", "wrap('ab cd', 5)", "['ab cd']"),
            ("wrap_empty", "", "wrap('')", "[]"),
            ("indent", "", "indent(['a', 'b'], 3)", "['   a', '   b']"),
        ]) + _cases("textutil/slug.py", [
            ("slugify", "", "slugify('Hello, World!  2 times')", "'hello-world-2-times'"),
            ("slugify_sep", "", "slugify('a b', '_')", "'a_b'"),
            ("truncate", "", "truncate('abcdefgh', 6)", "'abc...'"),
            ("truncate_short", "", "truncate('abc', 3)", "'abc'"),
            ("initials", "", "initials('ada king lovelace')", "'AKL'"),
        ])),
)

STATS = RepoTemplate(
    name="stats",
    package="stats",
    description="Pure-Python matrices and descriptive statistics.",
    modules={
        "stats/__init__.py": '"""Matrices and statistics."""\n',
        "stats/matrix.py": '''"""Matrices as lists of rows."""


def identity(n):
    return [[1 if i == j else 0 for j in range(n)] for i in range(n)]


def transpose(m):
    return [[m[i][j] for i in range(len(m))] for j in range(len(m[0]))]


def matmul(a, b):
    if len(a[0]) != len(b):
        raise ValueError("shapes do not match")
    out = []
    for i in range(len(a)):
        row = []
        for j in range(len(b[0])):
            total = 0
            for k in range(len(b)):
                total += a[i][k] * b[k][j]
            row.append(total)
        out.append(row)
    return out


def trace(m):
    total = 0
    for i in range(len(m)):
        total += m[i][i]
    return total
''',
        "stats/descriptive.py": '''"""Descriptive statistics."""


def mean(xs):
    if not xs:
        raise ValueError("mean of no data")
    return sum(xs) / len(xs)


def median(xs):
    ordered = sorted(xs)
    mid = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2


def variance(xs, ddof=0):
    m = mean(xs)
    total = 0
    for x in xs:
        total += (x - m) ** 2
    return total / (len(xs) - ddof)


def mode(xs):
    counts = {}
    for x in xs:
        counts[x] = counts.get(x, 0) + 1
    best = max(counts.values())
    return min(x for x in counts if counts[x] == best)
''',
        "stats/scale.py": '''"""Rescaling and smoothing."""

from stats.descriptive import mean


def min_max(xs):
    lo, hi = min(xs), max(xs)
    if hi == lo:
        return [0.0 for _ in xs]
    return [(x - lo) / (hi - lo) for x in xs]


def clip(xs, lo, hi):
    out = []
    for x in xs:
        if x < lo:
            x = lo
        elif x > hi:
            x = hi
        out.append(x)
    return out


def moving_average(xs, window=2):
    return [mean(xs[i : i + window]) for i in range(len(xs) - window + 1)]


def center(xs):
    m = mean(xs)
    return [x - m for x in xs]
''',
    },
    imports={
        "stats/matrix.py": "from stats.matrix import identity, matmul, trace, transpose",
        "stats/descriptive.py": "from stats.descriptive import mean, median, mode, variance",
        "stats/scale.py": "from stats.scale import center, clip, min_max, moving_average",
    },
    cases=tuple(
        _cases("stats/matrix.py", [
            ("identity", "", "identity(2)", "[[1, 0], [0, 1]]"),
            ("transpose", "", "transpose([[1, 2, 3], [4, 5, 6]])", "[[1, 4], [2, 5], [3, 6]]"),
            ("matmul", "", "matmul([[1, 2], [3, 4]], [[5, 6], [7, 8]])", "[[19, 22], [43, 50]]"),
            ("matmul_shapes", "", "matmul([[1, 2]], [[1, 2]])", "raises ValueError"),
            ("trace", "", "trace([[1, 2], [3, 4]])", "5"),
        ]) + _cases("stats/descriptive.py", [
            ("mean", "", "mean([1, 2, 3, 6])", "3.0"),
            ("mean_empty", "", "mean([])", "raises ValueError"),
            ("median_odd", "", "median([5, 1, 3])", "3"),
            ("median_even", "", "median([4, 1, 3, 2])", "2.5"),
            ("variance", "", "variance([1, 2, 3, 4])", "1.25"),
            ("sample_variance", "", "variance([1, 2, 3, 4], 1)", "1.6666666666666667"),
            ("mode", "", "mode([3, 1, 3, 1, 2])", "1"),
        ]) + _cases("stats/scale.py", [
            ("min_max", "", "min_max([2, 4, 6])", "[0.0, 0.5, 1.0]"),
            ("min_max_flat", "", "min_max([3, 3])", "[0.0, 0.0]"),
            ("clip", "", "clip([-2, 0, 5, 9], 0, 5)", "[0, 0, 5, 5]"),
            ("moving_average", "", "moving_average([1, 3, 5, 7])", "[2.0, 4.0, 6.0]"),
            ("center", "", "center([1, 2, 6])", "[-2.0, -1.0, 3.0]"),
        ])),
)

CALENDAR = RepoTemplate(
    name="calendar",
    package="caltools",
    description="Calendar arithmetic without the standard library's datetime: leap years, days and weeks.",
    modules={
        "caltools/__init__.py": '"""Calendar arithmetic."""\n',
        "caltools/leap.py": '''"""Leap years and month lengths."""

MONTH_DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


def is_leap(year):
    if year % 400 == 0:
        return True
    if year % 100 == 0:
        return False
    return year % 4 == 0


def days_in_month(year, month):
    if month < 1 or month > 12:
        raise ValueError("month must be in 1..12")
    if month == 2 and is_leap(year):
        return 29
    return MONTH_DAYS[month - 1]


def days_in_year(year):
    return 366 if is_leap(year) else 365
''',
        "caltools/dates.py": '''"""Day numbers within a year."""

from caltools.leap import days_in_month, days_in_year


def day_of_year(year, month, day):
    total = day
    for m in range(1, month):
        total += days_in_month(year, m)
    return total


def from_day_of_year(year, n):
    if n < 1 or n > days_in_year(year):
        raise ValueError("day out of range")
    month = 1
    for m in range(1, 13):
        length = days_in_month(year, m)
        if n <= length:
            month = m
            break
        n -= length
    return (month, n)


def days_between(year, start, end):
    return day_of_year(year, *end) - day_of_year(year, *start)
''',
        "caltools/weeks.py": '''"""Weekdays and weeks."""

from caltools.dates import day_of_year

NAMES = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def weekday(year, month, day):
    if month < 3:
        month += 12
        year -= 1
    k = year % 100
    j = year // 100
    h = (day + 13 * (month + 1) // 5 + k + k // 4 + j // 4 + 5 * j) % 7
    return (h + 5) % 7


def weekday_name(year, month, day):
    return NAMES[weekday(year, month, day)]


def week_of_year(year, month, day):
    return (day_of_year(year, month, day) - 1) // 7 + 1
''',
    },
    imports={
        "caltools/leap.py": "from caltools.leap import days_in_month, days_in_year, is_leap",
        "caltools/dates.py": "from caltools.dates import day_of_year, days_between, from_day_of_year",
        "caltools/weeks.py": "from caltools.weeks import week_of_year, weekday, weekday_name",
    },
    cases=tuple(
        _cases("caltools/leap.py", [
            ("leap_2024", "", "is_leap(2024)", "True"),
            ("leap_1900", "", "is_leap(1900)", "False"),
            ("leap_2000", "", "is_leap(2000)", "True"),
            ("february_leap", "", "days_in_month(2024, 2)", "29"),
            ("april", "", "days_in_month(2023, 4)", "30"),
            ("bad_month", "", "days_in_month(2023, 13)", "raises ValueError"),
            ("days_in_year", "", "days_in_year(2023)", "365"),
        ]) + _cases("caltools/dates.py", [
            ("day_of_year", "", "day_of_year(2023, 3, 1)", "60"),
            ("day_of_year_leap", "", "day_of_year(2024, 12, 31)", "366"),
            ("from_day_of_year", "", "from_day_of_year(2023, 32)", "(2, 1)"),
            ("from_day_out_of_range", "", "from_day_of_year(2023, 366)", "raises ValueError"),
            ("days_between", "", "days_between(2023, (1, 30), (2, 2))", "3"),
        ]) + _cases("caltools/weeks.py", [
            ("weekday", "", "weekday(2024, 1, 1)", "0"),
            ("weekday_name", "", "weekday_name(2023, 7, 4)", "'Tuesday'"),
            ("weekday_march", "", "weekday_name(2000, 3, 1)", "'Wednesday'"),
            ("week_of_year", "", "week_of_year(2023, 1, 8)", "2"),
        ])),
)

LEDGER = RepoTemplate(
    name="ledger",
    package="ledger",
    description="A bank ledger: accounts, interest and statements (amounts in cents).",
    modules={
        "ledger/__init__.py": '"""A bank ledger."""\n',
        "ledger/account.py": '''"""Accounts."""


class Account:
    def __init__(self, owner, balance=0, overdraft=0):
        self.owner = owner
        self.balance = balance
        self.overdraft = overdraft
        self.history = []

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount
        self.history.append(amount)

    def withdraw(self, amount):
        if amount <= 0:
            raise ValueError("withdrawal must be positive")
        if self.balance - amount < -self.overdraft:
            raise ValueError("insufficient funds")
        self.balance -= amount
        self.history.append(-amount)

    def transfer(self, other, amount):
        self.withdraw(amount)
        other.deposit(amount)
''',
        "ledger/interest.py": '''"""Interest."""


def simple_interest(principal, rate_percent, years):
    return principal * rate_percent * years // 100


def compound(principal, rate_percent, years, periods=1):
    amount = principal
    for _ in range(years * periods):
        amount += amount * rate_percent // (100 * periods)
    return amount


def apply_fee(balance, fee=100, minimum=10000):
    if balance < minimum:
        return balance - fee
    return balance
''',
        "ledger/statement.py": '''"""Statements over an account's history."""


def running_balances(opening, history):
    balances = []
    balance = opening
    for amount in history:
        balance += amount
        balances.append(balance)
    return balances


def totals(history):
    credits = 0
    debits = 0
    for amount in history:
        if amount > 0:
            credits += amount
        else:
            debits -= amount
    return {"credits": credits, "debits": debits}


def largest_withdrawal(history):
    largest = 0
    for amount in history:
        if -amount > largest:
            largest = -amount
    return largest
''',
    },
    imports={
        "ledger/account.py": "from ledger.account import Account",
        "ledger/interest.py": "from ledger.interest import apply_fee, compound, simple_interest",
        "ledger/statement.py": "from ledger.account import Account\n"
                               "from ledger.statement import largest_withdrawal, running_balances, totals",
    },
    cases=tuple(
        _cases("ledger/account.py", [
            ("deposit", "a = Account('ann', 100)\na.deposit(50)", "a.balance", "150"),
            ("withdraw", "a = Account('ann', 100)\na.withdraw(30)", "a.balance", "70"),
            ("withdraw_all", "a = Account('ann', 100)\na.withdraw(100)", "a.balance", "0"),
            ("overdraft", "a = Account('ann', 100, overdraft=50)\na.withdraw(150)", "a.balance", "-50"),
            ("insufficient", "a = Account('ann', 100)", "a.withdraw(101)", "raises ValueError"),
            ("zero_deposit", "a = Account('ann')", "a.deposit(0)", "raises ValueError"),
            ("transfer", "a = Account('ann', 100)\nb = Account('bob', 5)\na.transfer(b, 40)",
             "(a.balance, b.balance)", "(60, 45)"),
            ("history", "a = Account('ann', 10)\na.deposit(5)\na.withdraw(3)", "a.history", "[5, -3]"),
        ]) + _cases("ledger/interest.py", [
            ("simple_interest", "", "simple_interest(10000, 5, 2)", "1000"),
            ("compound", "", "compound(10000, 10, 2)", "12100"),
            ("compound_periods", "", "compound(10000, 10, 1, 2)", "11025"),
            ("fee_below_minimum", "", "apply_fee(5000)", "4900"),
            ("no_fee_at_minimum", "", "apply_fee(10000)", "10000"),
        ]) + _cases("ledger/statement.py", [
            ("running_balances", "", "running_balances(100, [50, -30, 10])", "[150, 120, 130]"),
            ("totals", "", "totals([50, -30, 10, -5])", "{'credits': 60, 'debits': 35}"),
            ("largest_withdrawal", "", "largest_withdrawal([50, -30, 10, -45])", "45"),
            ("statement_of_account", "a = Account('ann', 100)\na.withdraw(20)\na.deposit(5)",
             "running_balances(100, a.history)", "[80, 85]"),
        ])),
)

GRAPH = RepoTemplate(
    name="graph",
    package="graphs",
    description="Undirected graphs: adjacency, breadth-first search and weighted paths.",
    modules={
        "graphs/__init__.py": '"""Undirected graphs."""\n',
        "graphs/graph.py": '''"""Adjacency sets."""


class Graph:
    def __init__(self):
        self.adj = {}
        self.weights = {}

    def add_node(self, node):
        self.adj.setdefault(node, set())

    def add_edge(self, a, b, weight=1):
        self.add_node(a)
        self.add_node(b)
        self.adj[a].add(b)
        self.adj[b].add(a)
        self.weights[(a, b)] = weight
        self.weights[(b, a)] = weight

    def neighbors(self, node):
        return sorted(self.adj.get(node, ()))

    def degree(self, node):
        return len(self.adj.get(node, ()))

    def edge_count(self):
        return sum(len(n) for n in self.adj.values()) // 2
''',
        "graphs/search.py": '''"""Breadth-first search."""


def bfs_order(graph, start):
    order = [start]
    seen = {start}
    frontier = [start]
    for _ in range(len(graph.adj)):
        following = []
        for node in frontier:
            for nxt in graph.neighbors(node):
                if nxt not in seen:
                    seen.add(nxt)
                    order.append(nxt)
                    following.append(nxt)
        frontier = following
    return order


def distances(graph, start):
    dist = {start: 0}
    frontier = [start]
    for step in range(1, len(graph.adj) + 1):
        following = []
        for node in frontier:
            for nxt in graph.neighbors(node):
                if nxt not in dist:
                    dist[nxt] = step
                    following.append(nxt)
        frontier = following
    return dist


def connected(graph, a, b):
    return b in distances(graph, a)


def components(graph):
    seen = set()
    count = 0
    for node in sorted(graph.adj):
        if node not in seen:
            count += 1
            seen.update(bfs_order(graph, node))
    return count
''',
        "graphs/paths.py": '''"""Weighted paths."""


def path_weight(graph, path):
    total = 0
    for i in range(len(path) - 1):
        edge = (path[i], path[i + 1])
        if edge not in graph.weights:
            raise ValueError("no edge")
        total += graph.weights[edge]
    return total


def is_path(graph, path):
    for i in range(1, len(path)):
        if path[i] not in graph.adj.get(path[i - 1], ()):
            return False
    return True


def heaviest_edge(graph):
    best = None
    for edge, weight in sorted(graph.weights.items()):
        if best is None or weight > best[1]:
            best = (edge, weight)
    return best
''',
    },
    imports={
        "graphs/graph.py": "from graphs.graph import Graph",
        "graphs/search.py": "from graphs.graph import Graph\nfrom graphs.search import bfs_order, components, "
                            "connected, distances",
        "graphs/paths.py": "from graphs.graph import Graph\nfrom graphs.paths import heaviest_edge, is_path, "
                           "path_weight",
    },
    cases=tuple(
        _cases("graphs/graph.py", [
            ("neighbors", "g = Graph()\ng.add_edge('a', 'c')\ng.add_edge('a', 'b')", "g.neighbors('a')",
             "['b', 'c']"),
            ("undirected", "g = Graph()\ng.add_edge('a', 'b')", "g.neighbors('b')", "['a']"),
            ("degree", "g = Graph()\ng.add_edge(1, 2)\ng.add_edge(1, 3)\ng.add_node(4)", "(g.degree(1), g.degree(4))",
             "(2, 0)"),
            ("edge_count", "g = Graph()\ng.add_edge(1, 2)\ng.add_edge(2, 3)\ng.add_edge(1, 2)", "g.edge_count()",
             "2"),
        ]) + _cases("graphs/search.py", [
            ("bfs_order", "g = Graph()\ng.add_edge(1, 2)\ng.add_edge(1, 3)\ng.add_edge(2, 4)", "bfs_order(g, 1)",
             "[1, 2, 3, 4]"),
            ("distances", "g = Graph()\ng.add_edge(1, 2)\ng.add_edge(2, 3)", "distances(g, 1)", "{1: 0, 2: 1, 3: 2}"),
            ("connected", "g = Graph()\ng.add_edge(1, 2)\ng.add_node(3)", "(connected(g, 1, 2), connected(g, 1, 3))",
             "(True, False)"),
            ("components", "g = Graph()\ng.add_edge(1, 2)\ng.add_edge(3, 4)\ng.add_node(5)", "components(g)", "3"),
        ]) + _cases("graphs/paths.py", [
            ("path_weight", "g = Graph()\ng.add_edge('a', 'b', 2)\ng.add_edge('b', 'c', 5)",
             "path_weight(g, ['a', 'b', 'c'])", "7"),
            ("path_weight_missing", "g = Graph()\ng.add_edge('a', 'b')", "path_weight(g, ['a', 'c'])",
             "raises ValueError"),
            ("is_path", "g = Graph()\ng.add_edge(1, 2)\ng.add_edge(2, 3)", "(is_path(g, [1, 2, 3]), is_path(g, [1, 3]))",
             "(True, False)"),
            ("heaviest_edge", "g = Graph()\ng.add_edge(1, 2, 4)\ng.add_edge(2, 3, 9)", "heaviest_edge(g)",
             "((2, 3), 9)"),
        ])),
)

TEMPLATES: dict[str, RepoTemplate] = {t.name: t for t in (INVENTORY, TEXTUTIL, STATS, CALENDAR, LEDGER, GRAPH)}
"""Template name -> template."""
