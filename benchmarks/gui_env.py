"""What does a GUI tool step cost through the sandbox service, against raw Playwright, and how many browsers fit?

1. One tool step on the same page (a click on the settings page's "Newsletter" box, which changes the page but
   does not navigate), two ways, in the same run, in pairs of one step each way with both browsers open, the
   order within a pair alternating (so a load that drifts weighs on both alike, and neither way always goes
   second):

    raw       Playwright in this process, nothing of ours: `chromium.launch` with Playwright's defaults, the     the baseline
              page served here over HTTP, `page.mouse.click`, then the observation's reads
    service   BrowserSession.step("click", ...) in a sandbox of the embedded service (JSON over the sandbox      what a user pays
              terminal, the host in its jail in the sandbox, its settle check, the tabs' titles)

   for both kinds of step a policy takes:

    text      the text view and the tab's title, no screenshot (a text-only policy: the CPU recipe)
    image     the screenshot (PNG) and the tab's title, no text view (a vision policy)

   Target: service <= 1.2 x raw, as the median over pairs of service / raw (a pair's two steps meet the same
   load), with a bootstrap 95 % interval of that median and the quartiles of the pairs' ratios as the spread;
   the ratio of the two ways' medians is printed beside it. A text step must take no screenshot: its
   observation's screenshot is checked empty on every step.

2. Browsers alive at once: open `--browsers` sessions one after another, keep them all open, and take each
   sandbox's memory as the proportional set size (PSS, shared pages split among their users) of its uid's
   processes, from /proc/<pid>/smaps_rollup, also by process kind. Target: >= 8 browsers at <= 250 MiB each.

    python benchmarks/gui_env.py                    # 100 pairs of each kind, 8 browsers
    python benchmarks/gui_env.py --browsers 0       # the steps only
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from orchard.domains.gui import BrowserSession
from orchard.domains.gui._host import _TEXT_VIEW_JS
from orchard.domains.gui.sites import Sites, serve_sites
from orchard.env import SandboxClient
from orchard.env.embedded import serve

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
PAGE = "/forms/settings"
# the "Newsletter" checkbox of the settings page: a click that changes the page but does not navigate
TARGET = "Newsletter"
KINDS = ("text", "image")


def machine() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{platform.machine()}, {os.cpu_count()} cpus, load avg {load}; python {platform.python_version()}; " \
           f"commit {commit}"


def centre(text: str, name: str) -> tuple[int, int]:
    line = next(line for line in text.splitlines() if f'"{name}"' in line)
    x, y = line.rsplit("@(", 1)[1].rstrip(")").split(",")
    return int(x), int(y)


def ms(samples: list[float], q: int) -> float:
    """The q-th percentile (1-99) of `samples` (seconds) in ms."""
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1] * 1000


def pairs(client: SandboxClient, n: int) -> dict[str, tuple[list[float], list[float]]]:
    """For each kind of step, `n` timed pairs of one step each way (after 3 untimed), the way that goes first
    alternating from pair to pair, both browsers open at once: a load that changes during the run weighs on
    both ways alike. Returns kind -> (service seconds, raw seconds)."""
    from playwright.sync_api import sync_playwright

    server = serve_sites(Sites(0), 0)
    times: dict[str, tuple[list[float], list[float]]] = {}
    with BrowserSession.open(client, seed=0, text_view=True, screenshots=False) as browser, \
            sync_playwright() as pw:
        x, y = centre(browser.reset(BrowserSession.url(PAGE)).text, TARGET)
        raw_browser = pw.chromium.launch(executable_path=CHROMIUM)
        page = raw_browser.new_page(viewport={"width": 1280, "height": 720})
        page.goto(f"http://127.0.0.1:{server.server_address[1]}{PAGE}")

        def service_step(kind: str) -> float:
            start = time.perf_counter()
            obs = browser.step("click", {"x": x, "y": y}, text_view=kind == "text", screenshot=kind == "image")
            took = time.perf_counter() - start
            assert obs.error is None and obs.env_error is None, obs.error or obs.env_error
            assert (kind == "text") == (obs.text is not None) and (kind == "image") == bool(obs.screenshot)
            return took

        def raw_step(kind: str) -> float:
            start = time.perf_counter()
            page.mouse.click(x, y)
            if kind == "text":
                page.evaluate(_TEXT_VIEW_JS)
            else:
                page.screenshot(type="png")
            page.title()
            return time.perf_counter() - start

        for kind in KINDS:
            service, raw = [], []
            for i in range(n + 3):
                ways: list[tuple[list[float], Callable[[str], float]]] = [(service, service_step), (raw, raw_step)]
                for samples, step in ways[::-1] if i % 2 else ways:
                    samples.append(step(kind))
            times[kind] = service[3:], raw[3:]
        raw_browser.close()
    server.shutdown()
    return times


def process_kind(argv: list[str]) -> str:
    """python (the host), node (Playwright's driver), chromium:<--type> ("chromium" is the browser process)."""
    if not argv:
        return "?"
    name = Path(argv[0]).name
    kind = next((a[len("--type="):] for a in argv if a.startswith("--type=")), None)
    if "chromium" not in name and kind is None:
        return "python" if name.startswith("python") else name
    return "chromium" if kind is None else f"chromium:{kind}"


def pss_by_kind(uid: int) -> dict[str, float]:
    """MiB of proportional set size of a uid's processes, by process kind."""
    kinds: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            rollup = (entry / "smaps_rollup").read_text()
            # Chromium rewrites its children's command lines into one string: split on spaces too
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split()
        except OSError:
            continue
        pss = next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
        kinds[process_kind(argv)] = kinds.get(process_kind(argv), 0.0) + pss / 1024
    return kinds


def pair_ratios(service: list[float], raw: list[float], resamples: int = 2000) -> dict[str, float]:
    """The median of the pairs' service / raw ratios, their quartiles (how much one pair's ratio scatters)
    and a 95 % bootstrap interval of the median (how well the pairs pin it down: pairs resampled with
    replacement, seeded)."""
    ratios = [s / r for s, r in zip(service, raw, strict=True)]
    q25, median, q75 = statistics.quantiles(ratios, n=4, method="inclusive")
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return {"median": median, "q25": q25, "q75": q75, "lo": medians[int(0.025 * resamples)],
            "hi": medians[int(0.975 * resamples) - 1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=100, help="timed pairs of one step each way, per kind")
    parser.add_argument("--browsers", type=int, default=8, help="browsers to keep open at once (0: skip part 2)")
    args = parser.parse_args()
    if args.pairs < 4:
        parser.error(f"--pairs must be >= 4 (quartiles), got {args.pairs}")
    if args.browsers < 0:
        parser.error(f"--browsers must be >= 0, got {args.browsers}")
    print(machine())
    with serve(reap_interval_s=1.0) as (url, key), SandboxClient(url, key) as client:
        times = pairs(client, args.pairs)
        print(f"\none tool step (a click, then the observation), {args.pairs} pairs of one step each way, ms")
        print(f"{'step':<8}{'way':<10}{'p25':>8}{'p50':>8}{'p75':>8}{'p90':>8}")
        for kind in KINDS:
            service, raw = times[kind]
            for name, samples in (("raw", raw), ("service", service)):
                print(f"{kind:<8}{name:<10}" + "".join(f"{ms(samples, q):>8.1f}" for q in (25, 50, 75, 90)))
        for kind in KINDS:
            service, raw = times[kind]
            r = pair_ratios(service, raw)
            print(f"{kind}: service / raw Playwright, median of the pairs' ratios: {r['median']:.2f} x (95 % interval "
                  f"{r['lo']:.2f} - {r['hi']:.2f}; pairs' quartiles {r['q25']:.2f} - {r['q75']:.2f}; ratio of the "
                  f"p50s {statistics.median(service) / statistics.median(raw):.2f} x; target <= 1.2)")
        print("text steps took no screenshot (each observation's screenshot checked empty)")
        print(f"load avg at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
        if args.browsers == 0:
            return

        sessions, start = [], time.perf_counter()
        try:
            for _ in range(args.browsers):
                session = BrowserSession.open(client, seed=0)
                session.reset(BrowserSession.url("/shop/"))
                sessions.append(session)
            alive = sum(s.observe().env_error is None for s in sessions)
            kinds = [pss_by_kind(s.uid) for s in sessions]
        finally:
            for s in sessions:
                s.close()
        memory = [sum(k.values()) for k in kinds]
        print(f"\n{alive} of {args.browsers} browsers alive at once (opened in {time.perf_counter() - start:.0f} s); "
              f"PSS per browser (host + Playwright driver + Chromium) MiB: mean {statistics.mean(memory):.0f}, "
              f"max {max(memory):.0f} (target >= 8 at <= 250)")
        print(f"{'process (per browser)':<28}{'PSS MiB':>8}")
        for kind in sorted({k for ks in kinds for k in ks}, key=lambda k: -sum(ks.get(k, 0.0) for ks in kinds)):
            print(f"{kind:<28}{statistics.mean(ks.get(kind, 0.0) for ks in kinds):>8.1f}")


if __name__ == "__main__":
    main()
