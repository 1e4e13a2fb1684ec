"""What does a GUI tool step cost through the sandbox service, and how many browsers fit at once?

1. One tool step (a click, then the screenshot the agent sees) on the same page, two ways, in the same run:

    direct    Playwright in this process drives a local Chromium on the sites served here      the baseline
    service   BrowserSession.step("click", ...) in a sandbox of the embedded service           what a user pays
              (JSON over the sandbox terminal, the host in the sandbox, the same click, screenshot, base64)

   Both wait on page events (the host's settle: the page's own submit/unload/new-tab events, then load), never on
   a fixed sleep; the paper's environment sleeps 0.5-5 s after each action. Target: service p50 <= 1.2 x direct.

2. Browsers alive at once: open `--browsers` sessions one after another, keep them all open, and take each
   sandbox's memory as the proportional set size (PSS, shared pages split among their users) of its uid's
   processes. Target: >= 8 browsers at <= 250 MiB each.

    python benchmarks/gui_env.py                    # 30 steps each, 8 browsers
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from orchard.domains.gui import BrowserSession
from orchard.domains.gui.sites import Sites, serve_sites
from orchard.env import SandboxClient
from orchard.env.embedded import serve

REPO = Path(__file__).resolve().parents[1]
PAGE = "/forms/settings"
# the "Newsletter" checkbox of the settings page: a click that changes the page but does not navigate
TARGET = "Newsletter"


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


def p50(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def direct_steps(n: int, x: int, y: int) -> list[float]:
    from playwright.sync_api import sync_playwright

    from orchard.domains.gui._host import Host

    server = serve_sites(Sites(0), 0)
    url = f"http://127.0.0.1:{server.server_address[1]}{PAGE}"
    with sync_playwright() as pw:
        host = Host(pw, "/usr/bin/chromium", 1280, 720)
        host.goto(host.page, url)
        times = []
        for _ in range(n + 3):
            start = time.perf_counter()
            host.page.mouse.click(x, y)
            host.settle(1)
            host.page.screenshot(type="png")
            times.append(time.perf_counter() - start)
        host.browser.close()
    server.shutdown()
    return times[3:]


def service_steps(client: SandboxClient, n: int) -> tuple[list[float], tuple[int, int]]:
    with BrowserSession.open(client, seed=0, text_view=True) as browser:
        x, y = centre(browser.reset(BrowserSession.url(PAGE)).text, TARGET)
        times = []
        for _ in range(n + 3):
            start = time.perf_counter()
            obs = browser.step("click", {"x": x, "y": y}, text_view=False)
            times.append(time.perf_counter() - start)
            assert obs.error is None and obs.screenshot, obs.error
    return times[3:], (x, y)


def pss_mib(uid: int) -> float:
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            rollup = (entry / "smaps_rollup").read_text()
        except OSError:
            continue
        total += next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
    return total / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30, help="timed steps each way")
    parser.add_argument("--browsers", type=int, default=8, help="browsers to keep open at once")
    args = parser.parse_args()
    print(machine())
    with serve(reap_interval_s=1.0) as (url, key), SandboxClient(url, key) as client:
        service, (x, y) = service_steps(client, args.n)
        direct = direct_steps(args.n, x, y)
        print(f"\none tool step (click + screenshot), {args.n} steps each, p50 / p90 ms")
        print(f"{'way':<10}{'p50':>8}{'p90':>8}")
        for name, samples in (("direct", direct), ("service", service)):
            print(f"{name:<10}{p50(samples):>8.1f}{statistics.quantiles(samples, n=10)[-1] * 1000:>8.1f}")
        print(f"service / direct p50: {p50(service) / p50(direct):.2f} x (target <= 1.2)")

        sessions, start = [], time.perf_counter()
        try:
            for _ in range(args.browsers):
                session = BrowserSession.open(client, seed=0)
                session.reset(BrowserSession.url("/shop/"))
                sessions.append(session)
            alive = sum(s.observe().env_error is None for s in sessions)
            memory = [pss_mib(s.uid) for s in sessions]
        finally:
            for s in sessions:
                s.close()
        print(f"\n{alive} of {args.browsers} browsers alive at once (opened in {time.perf_counter() - start:.0f} s); "
              f"PSS per browser (host + Playwright driver + Chromium) MiB: mean {statistics.mean(memory):.0f}, "
              f"max {max(memory):.0f} (target >= 8 at <= 250)")


if __name__ == "__main__":
    main()
