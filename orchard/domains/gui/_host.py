"""The browser host: one process inside a GUI sandbox that serves the sites and drives Chromium with Playwright.

Standard library and Playwright only: `BrowserSession` uploads this file and `sites.py` into the sandbox and
runs `python3 _host.py ...` there as a sandbox terminal (the service's PTY), under the sandbox's isolation and,
inside it, a narrower bubblewrap of the browser's own (`session.browser_jail`). The Playwright driver and
Chromium are its descendants and die together with the terminal: the terminal's bubblewrap ends its pid
namespace when the session closes or the sandbox is deleted.

The sites listen on no socket: the browser context routes every request for the sites' origin (`--origin`,
``http://127.0.0.1:8000``) to `sites.Sites.handle` in this process and fulfils it from there. Nothing else can
reach them, with the sandbox's network on (a host process on the shared loopback) or off, and any number of
sandboxes use the same origin at once.

Protocol over the terminal, which the host puts in raw mode first (no echo, no newline translation: 8-bit
clean): the client writes one JSON object per line, `{"op": ...}`; the host answers each with one line
`FRAME_MARK + JSON + "\\n"`, and when the JSON has `"payload": n`, n raw bytes after the newline (the
screenshot's PNG: base64 would make the frame a third longer). A payload over `INLINE_PAYLOAD_MAX` bytes goes
to the file `--payload-file` instead, which the JSON names as `"payload_file"` and the client downloads: a
terminal hands its output on in pieces of at most 4095 bytes, each a wake-up of the kernel's worker and of the
service's reader, and a 110 KB screenshot took 50-80 ms that way, 12-17 ms with the download (issue 19). Only
the answer frames go to the terminal: the host keeps a private copy of it and points its own stdout and stderr
(which Chromium and the Playwright driver inherit) at a log file.

Requests: `observe {text_view, screenshot}`, `tool {name, arguments, text_view, screenshot}`,
`reset {url, text_view, screenshot, fresh_state}`, `state`, `close`.
An answer carries either an observation (`tabs`, `active`, `viewport`, optional `text`, `error` for an invalid
or failed action; its screenshot, when asked (`screenshot`, default true), is the payload) or `state`;
`env_error` says the browser itself is gone.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import re
import sys
import termios
import tty
from typing import Any
from urllib.parse import urlsplit

FRAME_MARK = "\x1eORCHARD-GUI "
INLINE_PAYLOAD_MAX = 65536
"""The largest payload sent over the terminal; larger ones go through `--payload-file`. One read of the exec
agent's terminal (64 KiB) relays up to this much at once; beyond it the pieces and relays add up."""
_NAV_TIMEOUT_MS = 15000
_MAX_WAIT_S = 10.0

# A flattened accessibility view: visible elements a user can act on or read, each with its role, accessible
# name and the centre of its box in viewport pixels (what a text-only policy passes to click). An element that
# holds text repeating what the visitor entered (the site marks it data-entered) says so with the word
# `entered`: with form fields (whose names show their values), the text the site did not write itself.
_TEXT_VIEW_JS = """() => {
  const W = window.innerWidth, H = window.innerHeight, out = [];
  const roles = {A: 'link', BUTTON: 'button', SELECT: 'combobox', TEXTAREA: 'textbox', H1: 'heading',
                 H2: 'heading', H3: 'heading', TD: 'cell', TH: 'columnheader', LABEL: 'label', P: 'text',
                 LI: 'listitem', OPTION: null};
  const inputRole = t => ({checkbox: 'checkbox', radio: 'radio', submit: 'button', button: 'button',
                           hidden: null}[t] ?? 'textbox');
  for (const el of document.querySelectorAll('a,button,input,select,textarea,h1,h2,h3,th,td,label,p,li,[role]')) {
    let role = el.getAttribute('role') || (el.tagName === 'INPUT' ? inputRole(el.type) : roles[el.tagName]);
    if (!role) continue;
    const r = el.getBoundingClientRect();
    if (r.width < 1 || r.height < 1 || r.bottom < 0 || r.right < 0 || r.top >= H || r.left >= W) continue;
    const x = Math.round(Math.min(Math.max(r.left + r.width / 2, 0), W - 1));
    const y = Math.round(Math.min(Math.max(r.top + r.height / 2, 0), H - 1));
    let name = el.getAttribute('aria-label') || '';
    if (!name && (role === 'checkbox' || role === 'radio') && el.labels && el.labels.length)
      name = el.labels[0].innerText.trim();
    if (!name && el.tagName === 'INPUT') name = el.value || el.placeholder || el.name || '';
    if (!name && el.tagName === 'SELECT') name = el.selectedIndex >= 0 ? el.options[el.selectedIndex].text : '';
    if (!name) name = (el.innerText || '').trim().replace(/\\s+/g, ' ').slice(0, 120);
    // a paragraph that only wraps a link or a button would repeat it
    const inner = el.querySelector('a,button,input,select,textarea');
    if (['text', 'listitem', 'label', 'cell'].includes(role) && inner
        && (inner.innerText || '').trim() === (el.innerText || '').trim()) continue;
    let extra = '';
    if (role === 'checkbox' || role === 'radio') extra = el.checked ? ' checked' : ' unchecked';
    if (el.closest('[data-entered]') || el.querySelector('[data-entered]')) extra += ' entered';
    out.push(`[${role}] ${JSON.stringify(name)}${extra} @(${x},${y})`);
  }
  return out.join('\\n');
}"""

# Every page records, as the events happen, that it is about to be left (a form submitted, a same-tab link
# followed, beforeunload) or that a link opened a new tab. A form's navigation starts in a task queued after the
# input event, so the action's return alone does not say whether a navigation is coming; these flags do.
_WATCH_JS = """(() => {
  const leave = () => { window.__orchardLeaving = true; };
  addEventListener('submit', e => { if (!e.defaultPrevented) leave(); });
  addEventListener('beforeunload', leave);
  addEventListener('click', e => {
    const a = e.target instanceof Element ? e.target.closest('a[href]') : null;
    if (!a || e.defaultPrevented || a.getAttribute('href').startsWith('#')) return;
    if (a.target === '_blank') window.__orchardOpened = (window.__orchardOpened || 0) + 1; else leave();
  });
})()"""
# Settled: the document loaded and not being left. The answer is [the tabs its links opened since the last
# settled answer, which it counts from 0 again, and the page's title], or false: one round trip to the page
# where three were (this check, the counter's reset, and the title the observation reads next).
_SETTLED_JS = """() => {
  if (document.readyState !== 'complete' || window.__orchardLeaving) return false;
  const opened = window.__orchardOpened || 0;
  window.__orchardOpened = 0;
  return [opened, document.title];
}"""

_NEXT_FRAMES_JS = "() => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(() => done(true))))"

# Chromium keeps only the last --disable-features / --enable-features switch, so ours repeat Playwright's own
# (1.65's chromiumSwitches; tests/domains/gui/test_gui_browser.py checks that none is lost).
_PLAYWRIGHT_DISABLED_FEATURES = (
    "AvoidUnnecessaryBeforeUnloadCheckSync", "DestroyProfileOnBrowserClose", "HttpsUpgrades",
    "HttpsFirstBalancedModeAutoEnable", "LensOverlay", "MediaRouter", "PaintHolding", "ThirdPartyStoragePartitioning",
    "AvoidCorsURLLoaderRestartOnRedirect", "TcpPortRandomizationWin", "OptimizationHints",
    "NetworkTimeServiceQuerying", "AimEnabled", "PreconnectToSearch", "msForceBrowserSignIn",
    "msEdgeUpdateLaunchServicesPreferredVersion")
_PLAYWRIGHT_ENABLED_FEATURES = ("CDPScreenshotNewSurface", "SkipListAccountsWithoutGaiaCookies")
# Memory: one headless browser per sandbox, on sites of one origin, and nothing of Chromium's own UI on screen
# (screenshots are the page's). Measured per process in benchmarks/README.md (issue 19).
CHROMIUM_ARGS = (
    "--disable-dev-shm-usage",  # /dev/shm is small or absent in a sandbox
    "--disable-gpu", "--in-process-gpu",  # no GPU: software compositing in the browser process, not a process of its own
    # one renderer for every tab, and no spare one kept warm: the sites are one origin, so site isolation
    # (whose job is to keep origins apart) would only add processes; the sandbox isolates the whole browser
    "--renderer-process-limit=1", "--disable-site-isolation-trials",
    "--disable-features=" + ",".join((*_PLAYWRIGHT_DISABLED_FEATURES,
                                      "IsolateOrigins", "site-per-process", "SpareRendererForSitePerProcess",
                                      # new headless mode preloads the (invisible) omnibox's WebUI renderer
                                      "PreloadTopChromeWebUI", "WebUIOmniboxPopup", "WebUIOmniboxAimPopup",
                                      "WebUIOmniboxFullPopup")),
    # the network stack in the browser process, not a utility process of its own
    "--enable-features=" + ",".join((*_PLAYWRIGHT_ENABLED_FEATURES, "NetworkServiceInProcess2")),
)
"""Chromium's switches besides Playwright's: `--no-sandbox` (Playwright's, from ``chromium_sandbox=False``: the
sandbox's bubblewrap isolates Chromium, and Chromium's own sandbox needs namespaces not available inside it),
and these, each cutting a process or memory (issue 19)."""
NODE_OPTIONS = "--max-semi-space-size=1"
"""The Playwright driver's (Node) V8 young generation in MiB per semi-space (default 16): about 10 MiB less
resident; the driver allocates little besides the screenshots, which go to the large-object space."""


class Host:
    """The browser, its tabs and the sites of one sandbox."""

    def __init__(self, playwright: Any, chromium: str, width: int, height: int, sites: Any = None,
                 origin: str = "") -> None:
        """`sites` (a `sites.Sites`), when given, answers every request for `origin` (scheme://host:port)."""
        self.width, self.height = width, height
        self.browser = playwright.chromium.launch(executable_path=chromium, chromium_sandbox=False,
                                                  args=list(CHROMIUM_ARGS))
        self.context = self.browser.new_context(viewport={"width": width, "height": height})
        self.context.add_init_script(_WATCH_JS)
        if sites is not None:
            # a regular expression, not a predicate: the driver matches it, so requests for other origins (the
            # network, when the sandbox has one) are not stopped on their way to this process
            self.context.route(re.compile("^" + re.escape(origin) + "/"), lambda route: _fulfil(route, sites))
        self.active = 0
        self.context.new_page()

    @property
    def pages(self) -> list[Any]:
        return self.context.pages

    @property
    def page(self) -> Any:
        self.active = min(self.active, len(self.pages) - 1)
        return self.pages[self.active]

    def alive(self) -> bool:
        return self.browser.is_connected() and bool(self.pages)

    @staticmethod
    def _screenshot(page: Any) -> bytes:
        """The tab's screenshot. A navigation that swaps the tab's renderer (a refused page is shown by a renderer
        of its own) can leave headless Chromium's view of the tab hidden, and every capture then fails ("Unable
        to capture screenshot"); bringing the tab to the front shows it again. Seen in about half of the episodes
        that met a network error; the second failure is the browser's, an env_error."""
        try:
            return page.screenshot(type="png")
        except Exception:
            page.bring_to_front()
            return page.screenshot(type="png")

    def observe(self, text_view: bool, titles: dict[Any, str] | None = None,
                screenshot: bool = True) -> tuple[dict[str, Any], bytes]:
        """The observation without its screenshot, and the screenshot (PNG; b"" unless `screenshot`: a text-only
        policy never sees it, and taking one costs more than the rest of a step). `titles`: tabs' titles read
        just before (by `settle`), not asked again."""
        page = self.page
        tabs = []
        for p in self.pages:
            title = (titles or {}).get(p)
            if title is None:
                try:
                    title = p.title()
                except Exception:  # a tab in the middle of a navigation has no title yet
                    title = ""
            tabs.append({"url": p.url, "title": title})
        obs: dict[str, Any] = {"tabs": tabs, "active": self.active, "viewport": [self.width, self.height]}
        png = self._screenshot(page) if screenshot else b""
        if text_view:
            obs["text"] = page.evaluate(_TEXT_VIEW_JS)
        return obs, png

    def settle(self, tabs_before: int) -> dict[Any, str]:
        """Wait on page events, never a fixed time: the navigation an action started (if any) until its page has
        loaded, and the tabs its links opened until they have. A slow page is observed as it is.

        Returns the active tab's title as of settling when no tab opened (the observation that follows shows
        it, as the title it would read a moment later), else no title."""
        page = self.page
        try:
            try:  # most actions leave the page as it is: asked once, settled at once
                settled = page.evaluate(_SETTLED_JS)
            except Exception:  # the document was replaced while asked
                settled = False
            if not settled:  # re-evaluated in the next document when a navigation replaces this one
                settled = page.wait_for_function(_SETTLED_JS, polling=20, timeout=_NAV_TIMEOUT_MS).json_value()
            opened, title = int(settled[0]), str(settled[1])
            while len(self.pages) < tabs_before + opened:
                self.context.wait_for_event("page", timeout=_NAV_TIMEOUT_MS)
            for new in self.pages[tabs_before:]:
                new.wait_for_load_state("load", timeout=_NAV_TIMEOUT_MS)
        except Exception:
            if not self.alive():
                raise
            return {}
        # waiting for new tabs gave the page time to change its title
        return {page: title} if len(self.pages) == tabs_before else {}

    def point(self, args: dict[str, Any], x: str, y: str) -> tuple[float, float]:
        px, py = _number(args, x), _number(args, y)
        if not (0 <= px < self.width and 0 <= py < self.height):
            raise ToolError(f"({x}, {y}) = ({px:g}, {py:g}) is outside the viewport "
                            f"[0, {self.width}) x [0, {self.height})")
        return px, py

    def tab(self, args: dict[str, Any], name: str = "tab_index") -> int:
        index = args[name]
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.pages):
            raise ToolError(f"{name} must be an int in [0, {len(self.pages) - 1}] (0-based, {len(self.pages)} "
                            f"tabs open), got {index!r}")
        return index

    def goto(self, page: Any, url: Any) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://", "about:blank")):
            raise ToolError(f"url must be an http(s) URL, got {url!r}")
        try:
            page.goto(url, wait_until="load", timeout=_NAV_TIMEOUT_MS)
        except Exception as exc:
            if not self.alive():
                raise
            raise ToolError(f"could not open {url!r}: {str(exc).splitlines()[0]}") from None

    def run_tool(self, name: str, args: dict[str, Any]) -> dict[Any, str]:
        """Run one tool; returns the tabs' titles `settle` read (for `observe`)."""
        spec = TOOL_ARGS.get(name)
        if spec is None:
            raise ToolError(f"unknown tool {name!r}; the tools are {', '.join(TOOL_ARGS)}")
        required, optional = spec
        if not isinstance(args, dict):
            raise ToolError(f"arguments must be an object, got {args!r}")
        missing = [a for a in required if a not in args]
        unknown = [a for a in args if a not in required and a not in optional]
        if missing or unknown:
            raise ToolError(f"{name} takes {', '.join(required + optional) or 'no arguments'}; "
                            f"missing {missing}, unknown {unknown}")
        page, mouse, keyboard = self.page, self.page.mouse, self.page.keyboard
        tabs_before = len(self.pages)
        if name == "click":
            mouse.click(*self.point(args, "x", "y"))
        elif name == "hover":
            mouse.move(*self.point(args, "x", "y"))
        elif name == "drag":
            start, end = self.point(args, "start_x", "start_y"), self.point(args, "end_x", "end_y")
            mouse.move(*start)
            mouse.down()
            mouse.move(*end, steps=8)
            mouse.up()
        elif name == "write":
            if not isinstance(args["text"], str):
                raise ToolError(f"text must be a string, got {args['text']!r}")
            keyboard.type(args["text"])
        elif name == "press_keys":
            keys = args["keys"]
            if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
                raise ToolError(f"keys must be a non-empty list of key names, got {keys!r}")
            try:
                keyboard.press("+".join(keys))
            except Exception as exc:
                if not self.alive():
                    raise
                raise ToolError(f"cannot press {keys!r}: {str(exc).splitlines()[0]}") from None
        elif name == "scroll":
            direction, amount = args["direction"], _number(args, "amount")
            if direction not in ("up", "down", "left", "right"):
                raise ToolError(f"direction must be one of up, down, left, right, got {direction!r}")
            if not 0.0 <= amount <= 1.0:
                raise ToolError(f"amount must be in [0.0, 1.0] (a fraction of the viewport), got {amount:g}")
            dx = {"left": -1, "right": 1}.get(direction, 0) * amount * self.width
            dy = {"up": -1, "down": 1}.get(direction, 0) * amount * self.height
            mouse.wheel(dx, dy)
            # the wheel event is handled before the page scrolls (a frame later): the observation waits for two
            # frames, which a screenshot used to wait for by itself
            page.evaluate(_NEXT_FRAMES_JS)
        elif name == "goto_url":
            self.goto(page, args["url"])
        elif name == "go_back":
            page.go_back(wait_until="load", timeout=_NAV_TIMEOUT_MS)
        elif name == "wait":
            seconds = _number(args, "seconds")
            if not 0 <= seconds <= _MAX_WAIT_S:
                raise ToolError(f"seconds must be in [0, {_MAX_WAIT_S:g}], got {seconds:g}")
            page.wait_for_timeout(seconds * 1000)
        elif name == "new_tab":
            url = args.get("url")
            if url is not None and not isinstance(url, str):
                raise ToolError(f"url must be a string, got {url!r}")
            new = self.context.new_page()
            self.active = len(self.pages) - 1
            if url:
                self.goto(new, url)
        elif name == "switch_tab":
            self.active = self.tab(args)
            self.page.bring_to_front()
        elif name == "close_tab":
            index = self.tab(args) if "tab_index" in args else self.active
            if len(self.pages) == 1:
                raise ToolError("cannot close the only tab")
            self.pages[index].close()
            if index < self.active or self.active >= len(self.pages):
                self.active -= 1
            self.page.bring_to_front()
        elif name == "done" and not isinstance(args["response"], str):
            raise ToolError(f"response must be a string, got {args['response']!r}")
        if name in ("click", "press_keys", "drag"):
            return self.settle(tabs_before)
        return {}

    def reset(self, url: str) -> None:
        """Close every tab but the first and open `url` in it."""
        for extra in self.pages[1:]:
            extra.close()
        self.active = 0
        self.goto(self.page, url)


def _fulfil(route: Any, sites: Any) -> None:
    """Answer one request for the sites from `sites.handle`, as their HTTP server would."""
    request = route.request
    parts = urlsplit(request.url)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        status, page = sites.handle(request.method, target, request.post_data_buffer or b"")
    except Exception as exc:  # a request the sites cannot answer must not leave the page waiting forever
        status, page = 500, f"{type(exc).__name__}: {exc}".encode()
    route.fulfill(status=status, body=page, content_type="text/html; charset=utf-8")


class ToolError(Exception):
    """An invalid or failed action: the policy sees it as an error observation; the episode goes on."""


TOOL_ARGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "click": (("x", "y"), ()), "hover": (("x", "y"), ()),
    "drag": (("start_x", "start_y", "end_x", "end_y"), ()), "write": (("text",), ()),
    "press_keys": (("keys",), ()), "scroll": (("direction", "amount"), ()), "goto_url": (("url",), ()),
    "go_back": ((), ()), "wait": (("seconds",), ()), "new_tab": ((), ("url",)), "switch_tab": (("tab_index",), ()),
    "close_tab": ((), ("tab_index",)), "done": (("response",), ()),
}
"""Each tool's (required, optional) arguments; `orchard.domains.gui.tools.GUI_TOOLS` has the full schemas."""


def _number(args: dict[str, Any], name: str) -> float:
    value = args[name]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ToolError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def frame_bytes(frame: dict[str, Any], payload: bytes = b"") -> bytes:
    """One answer as it crosses the terminal: the mark, the JSON line, then the payload's raw bytes."""
    if payload:
        frame = {**frame, "payload": len(payload)}
    return (FRAME_MARK + json.dumps(frame) + "\n").encode() + payload


def _serve(host: Host | None, sites: Any, send: Any, launch_error: str | None, text_default: bool) -> None:
    buffer = b""
    while True:
        chunk = os.read(0, 65536)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if not line.strip():
                continue
            try:
                request = json.loads(line)
                op = request["op"]
            except (ValueError, KeyError, TypeError) as exc:
                send({"error": f"bad request: {exc}"})
                continue
            if op == "close":
                send({"closed": True})
                return
            if op == "state":
                send({"state": sites.state.snapshot()})
                continue
            if host is None or not host.alive():
                send({"env_error": launch_error or "the browser is gone (crashed or killed)"})
                continue
            text_view = bool(request.get("text_view", text_default))
            screenshot = bool(request.get("screenshot", True))
            error, titles = None, {}
            try:
                if op == "tool":
                    titles = host.run_tool(str(request.get("name")), request.get("arguments") or {})
                elif op == "reset":
                    if request.get("fresh_state"):
                        sites.state = type(sites.state)()
                    host.reset(request["url"])
                elif op != "observe":
                    raise ToolError(f"unknown op {op!r}")
            except ToolError as exc:
                error = str(exc)
            except Exception as exc:
                if not host.alive():
                    send({"env_error": f"the browser is gone: {type(exc).__name__}: {str(exc)[:300]}"})
                    continue
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            try:
                obs, png = host.observe(text_view, titles, screenshot)
            except Exception as exc:
                send({"env_error": f"cannot observe the browser: {type(exc).__name__}: {str(exc)[:300]}"})
                continue
            obs["error"] = error
            send({"observation": obs}, png)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--origin", default="http://127.0.0.1:8000", help="the sites' origin (no trailing /)")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=720)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--lock", default=".gui.lock")
    parser.add_argument("--log", default="gui-host.log")
    parser.add_argument("--payload-file", default="gui-payload.bin")
    parser.add_argument("--text-view", action="store_true")
    args = parser.parse_args(argv)

    out = os.dup(1)
    for fd in {0, out}:  # the same terminal, normally; raw both ways in any case, the payload is binary
        if os.isatty(fd):
            tty.setraw(fd, termios.TCSANOW)
    log = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)

    def send(frame: dict[str, Any], payload: bytes = b"") -> None:
        if len(payload) > INLINE_PAYLOAD_MAX:  # written before its frame is sent, read before the next request
            with open(args.payload_file, "wb") as f:
                f.write(payload)
            frame, payload = {**frame, "payload": len(payload), "payload_file": args.payload_file}, b""
        data = frame_bytes(frame, payload)
        while data:
            data = data[os.write(out, data):]

    # One browser per sandbox: the lock lives in the workspace, which every terminal of the sandbox shares,
    # and is released by the kernel when this process dies however it dies.
    lock = os.open(args.lock, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        send({"hello": False, "env_error": "a browser is already running in this sandbox"})
        return

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import sites as sites_module

    sites = sites_module.Sites(args.seed)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        send({"hello": False, "env_error": (
            f"playwright is not importable in the sandbox ({exc}; PYTHONPATH="
            f"{os.environ.get('PYTHONPATH', '')!r}): run `bash scripts/setup` (as root it installs Playwright for "
            "sandboxes in /opt/orchard/gui-site and records it), or set ORCHARD_GUI_PLAYWRIGHT_PATH to a folder "
            "holding Playwright that sandboxes can read")})
        return
    # the driver inherits this process's environment
    os.environ["NODE_OPTIONS"] = f"{os.environ.get('NODE_OPTIONS', '')} {NODE_OPTIONS}".strip()
    with sync_playwright() as playwright:
        host, launch_error = None, None
        try:
            host = Host(playwright, args.chromium, args.width, args.height, sites, args.origin)
        except Exception as exc:
            launch_error = f"Chromium did not start: {type(exc).__name__}: {str(exc)[:500]}"
        send({"hello": host is not None, "uid": os.getuid(), "pid": os.getpid(), "env_error": launch_error,
              "base_url": args.origin})
        if host is not None:
            _serve(host, sites, send, launch_error, args.text_view)
            try:
                host.browser.close()
            except Exception:
                pass  # already gone


if __name__ == "__main__":
    main()
