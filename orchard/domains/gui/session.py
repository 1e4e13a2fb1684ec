"""A browser in a sandbox: Chromium driven by Playwright inside the sandbox, the sites served beside it.

    with SandboxClient() as client, BrowserSession.open(client, seed=3) as browser:
        obs = browser.reset(browser.url("/shop/"))
        obs = browser.step("click", {"x": 200, "y": 140})
        state = browser.site_state()          # the cart, orders, bookings and settings, for the verifier

Where the driver runs: inside the sandbox. `BrowserSession` uploads the browser host (`_host.py`) and the sites
(`sites.py`) into the workspace and starts the host as a sandbox terminal (the service's PTY); the host starts
Chromium through Playwright and answers JSON requests over the terminal (a screenshot over 64 KiB comes through
a file the answer names: see `_host`'s protocol). So the browser runs under the sandbox's isolation, in its
network namespace (with `block_network`, the default, it reaches the sites and nothing else), and it dies with
the terminal: closing the session, a lost connection or deleting the sandbox ends the terminal's bubblewrap,
whose pid namespace takes every Chromium process with it. Driving Chromium from outside over CDP would need a
port out of that namespace.

The sites are private to their sandbox with the network on or off: they listen on no socket, the browser context
answers requests for `SITE_ORIGIN` from the host's own `sites.Sites` (see `_host`). With ``block_network=False``
the browser shares the host's network and loopback, but nothing there can reach or change the sites' state,
and two such browsers run at once.

The browser sees less of the machine than a sandbox command: inside the sandbox, the host runs under a second
bubblewrap (`browser_jail`) that binds only the system folders (/usr, /etc and the /bin, /lib links), the
sandbox's Playwright folder, the sandbox's /proc and /dev, a fresh /tmp, and the workspace's `HOST_DIR`. The
sandbox's view of the host (on the "host" image, every world-readable file, a checkout included) and its
workspace stay out of its reach whether a URL check holds or not. The jail needs bubblewrap in the image and
user namespaces in the sandbox (the local backend's "host" image has both); ``jail=False`` runs the host with
the sandbox's own view (an image whose files are the browser's whole world, as in a Kubernetes pod).

One browser per sandbox (the host takes a lock in the workspace), one fixed viewport per session. Screenshots are
taken only when asked (``screenshots``, or per call): a text-only policy pays for none.

Resources (`browser_resources`): the paper gives each browser 1 vCPU and 8 GiB, resident limits that only a cgroup
enforces; the Kubernetes backend makes them the pod's requests and limits, so `open` asks it for exactly that. The
local backend's memory limit is RLIMIT_AS, an address-space cap per process, and Chromium's V8 reserves about a
terabyte of address space for its sandbox cage: below ~128 GiB Chromium dies at start (SIGTRAP). There `open` asks
for `BROWSER_MEMORY` (1024Gi, which caps no resident memory) and no CPU (its CPU limit is CPU seconds per
process, not a core).

The image needs python3 with Playwright and Chromium. On the "host" image the sandbox's python3 is the
system's, which usually lacks Playwright; `playwright_path` is put on its PYTHONPATH. By default it is
``$ORCHARD_GUI_PLAYWRIGHT_PATH``, else the folder `scripts/setup` recorded (it installs Playwright for sandboxes
into a system folder every sandbox can read and writes its path to `PLAYWRIGHT_PATH_RECORD` in the virtual
environment), else where this process found Playwright — which a sandbox cannot see when it is under ``/tmp``
(the sandbox's own tmpfs) or a home directory it may not enter. Playwright's Python part is pure Python plus
greenlet, so the two interpreters must share a minor version.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from orchard.domains.gui import _host, sites
from orchard.domains.gui.tools import Observation
from orchard.env import Sandbox, SandboxClient, SandboxError

BROWSER_MEMORY = "1024Gi"
"""The memory (RLIMIT_AS) `BrowserSession.open` asks the local backend for: see the module docstring."""
PAPER_BROWSER_RESOURCES = {"cpu": "1", "memory": "8Gi"}
"""The paper's resources per browser (1 vCPU, 8 GiB), asked of a backend whose limits are cgroups (Kubernetes)."""
HOST_DIR = ".orchard-gui"
"""The workspace folder the host, the sites, the lock and the host's log go to."""
SITE_ORIGIN = "http://127.0.0.1:8000"
"""Where the browser finds the sites; the browser context answers it itself, nothing listens there."""
_START_LOG_LINES = 20
"""How much of the host's log a failed start quotes."""


def browser_resources(backend: str) -> dict[str, str]:
    """The ``cpu`` / ``memory`` a browser's sandbox asks for on ``backend`` (what the service's ``/health`` names):
    ``{"memory": BROWSER_MEMORY}`` on ``local`` (an address-space rlimit Chromium can start under, and no CPU-seconds
    limit), the paper's `PAPER_BROWSER_RESOURCES` (1 vCPU, 8 GiB) on any other (Kubernetes: cgroup limits)."""
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a backend name such as 'local' or 'kubernetes', got {backend!r}")
    return {"memory": BROWSER_MEMORY} if backend == "local" else dict(PAPER_BROWSER_RESOURCES)


PLAYWRIGHT_PATH_ENV = "ORCHARD_GUI_PLAYWRIGHT_PATH"
"""Where a sandbox's python3 finds Playwright (a folder of packages), when set."""
PLAYWRIGHT_PATH_RECORD = "orchard-gui-playwright-path"
"""The file in the virtual environment (``sys.prefix``) where `scripts/setup` records the folder it installed
Playwright for sandboxes in."""


def default_playwright_path() -> str | None:
    """``$ORCHARD_GUI_PLAYWRIGHT_PATH``, else the folder recorded in ``sys.prefix/PLAYWRIGHT_PATH_RECORD`` (by
    `scripts/setup`) when it still holds Playwright, else the folder holding this interpreter's `playwright`
    package (and, by pip's layout, greenlet and pyee), or None when Playwright is not installed here."""
    if os.environ.get(PLAYWRIGHT_PATH_ENV):
        return os.environ[PLAYWRIGHT_PATH_ENV]
    with contextlib.suppress(OSError):
        recorded = (Path(sys.prefix) / PLAYWRIGHT_PATH_RECORD).read_text().strip()
        if recorded and (Path(recorded) / "playwright").is_dir():
            return recorded
    try:
        import playwright
    except ImportError:
        return None
    return str(Path(playwright.__file__).resolve().parents[1])


def browser_jail(workdir: str, playwright_path: str | None) -> list[str]:
    """The bubblewrap command (run inside the sandbox, before the host's own) that confines the browser host,
    the Playwright driver and Chromium to what they need.

    Bound read-only: /usr, /etc (the system's configuration the browser reads: fonts, certificates, name
    resolution, the dynamic linker's cache), /bin, /sbin and /lib* (each if the image has it; merged-/usr links
    resolve to their folders), `playwright_path`, and the sandbox's /proc (a fresh one would need a pid
    namespace whose /proc the kernel refuses under a root-started sandbox; processes outside the jail's user
    namespace stay closed to it all the same, `/proc/<pid>/root` included); /dev as the sandbox has it; a
    fresh /tmp; and ``workdir/HOST_DIR`` read-write (the host, the sites, the lock, the log, the screenshot
    file), `workdir` the working directory. Nothing of the network changes: the jail keeps the sandbox's
    network namespace.

    Args:
        workdir: the sandbox's working directory (absolute), where `HOST_DIR` lies.
        playwright_path: a folder of Python packages to bind at its own path, or None.
    """
    if not isinstance(workdir, str) or not workdir.startswith("/"):
        raise ValueError(f"workdir must be an absolute path, got {workdir!r}")
    if playwright_path is not None and (not isinstance(playwright_path, str) or not playwright_path.startswith("/")):
        raise ValueError(f"playwright_path must be an absolute path or None, got {playwright_path!r}")
    argv = ["bwrap", "--unshare-user", "--unshare-ipc", "--die-with-parent"]
    for system in ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        argv += ["--ro-bind-try", system, system]
    if playwright_path is not None:
        argv += ["--ro-bind", playwright_path, playwright_path]
    host_dir = f"{workdir.rstrip('/')}/{HOST_DIR}"
    argv += ["--ro-bind", "/proc", "/proc", "--dev-bind", "/dev", "/dev", "--tmpfs", "/tmp",
             "--bind", host_dir, host_dir, "--chdir", workdir, "--setenv", "HOME", "/tmp", "--"]
    return argv


class BrowserSession:
    """One browser in one sandbox; a context manager that closes the browser (and owned sandbox) on exit.

    Args:
        sandbox: a ready sandbox whose image has python3, Playwright (or `playwright_path`) and Chromium.
        seed: the sites' seed (the same seed gives the same products; tasks are built from it).
        viewport: (width, height) in pixels, fixed for the session. Default (1280, 720).
        text_view: add the text view (elements with centre coordinates) to every observation by default.
        screenshots: take the screenshot for every observation by default (False: only when a call asks; a
            text-only policy's steps then take none). Default True.
        chromium: Chromium's path inside the sandbox (the distribution's package; `scripts/setup` installs it).
        python: the sandbox's interpreter.
        playwright_path: an absolute folder to put on the host's PYTHONPATH (see the module docstring);
            "default": `default_playwright_path()`; None: nothing (the image's python3 has Playwright).
        jail: run the host under `browser_jail` inside the sandbox (see the module docstring). Default True.
        start_timeout: seconds to wait for Chromium to start.
        step_timeout: seconds to wait for one request's answer before the browser counts as gone.
        own_sandbox: delete `sandbox` on `close()` (what `open` does).

    Raises:
        SandboxError: the browser did not start; the message says why (the host's own words, what the terminal
            printed before it, and the end of the host's log).
    """

    def __init__(self, sandbox: Sandbox, *, seed: int = 0, viewport: tuple[int, int] = (1280, 720),
                 text_view: bool = False, screenshots: bool = True, chromium: str = "/usr/bin/chromium",
                 python: str = "python3", playwright_path: str | None = "default", jail: bool = True,
                 start_timeout: float = 60.0, step_timeout: float = 60.0, own_sandbox: bool = False) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if (not isinstance(viewport, tuple) or len(viewport) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and 64 <= v <= 4096 for v in viewport)):
            raise ValueError(f"viewport must be a (width, height) tuple of ints in [64, 4096], got {viewport!r}")
        for name, value in (("start_timeout", start_timeout), ("step_timeout", step_timeout)):
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        for name, flag in (("text_view", text_view), ("screenshots", screenshots), ("jail", jail)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        if playwright_path == "default":
            playwright_path = default_playwright_path()
        if playwright_path is not None and (not isinstance(playwright_path, str) or not playwright_path.startswith("/")):
            raise ValueError(f"playwright_path must be an absolute path, 'default' or None, got {playwright_path!r}")
        self.sandbox, self.seed, self.viewport, self.text_view = sandbox, seed, viewport, text_view
        self.screenshots = screenshots
        self.step_timeout = float(step_timeout)
        self.own_sandbox = own_sandbox
        self.env_error: str | None = None
        self.closed = False
        self._buffer = b""
        for source in (_host, sites):
            sandbox.upload(f"{HOST_DIR}/{Path(source.__file__).name}", Path(source.__file__).read_text())
        argv = [python, f"{HOST_DIR}/_host.py", "--seed", str(seed), "--origin", SITE_ORIGIN,
                "--width", str(viewport[0]), "--height", str(viewport[1]), "--chromium", chromium,
                "--lock", f"{HOST_DIR}/lock", "--log", f"{HOST_DIR}/host.log",
                "--payload-file", f"{HOST_DIR}/screenshot.png"]
        cwd = sandbox.info.get("workdir") or "/workspace"
        if jail:
            argv = [*browser_jail(cwd, playwright_path), *argv]
        env = f"PYTHONPATH={shlex.quote(playwright_path)} " if playwright_path else ""
        self._cwd = cwd
        self._pty = sandbox.pty(f"cd {shlex.quote(cwd)} && exec env {env}{shlex.join(argv)}")
        hello = self._receive(start_timeout)
        self.uid: int | None = hello.get("uid")
        """The sandbox uid the browser runs as (its processes are found by it)."""
        if not hello.get("hello"):
            error = self._start_failure(hello.get("env_error") or "the browser host did not start")
            self.close()
            raise SandboxError(f"no browser in sandbox {sandbox.sandbox_id}: {error}")

    def _start_failure(self, error: str) -> str:
        """`error` with what the terminal printed besides frames (bubblewrap's or python's own complaint, from
        before the host took its output over) and the last lines of the host's log (a traceback, Chromium's or
        the driver's words)."""
        printed = self._buffer.replace(_host.FRAME_MARK.encode(), b"").decode(errors="replace").strip()
        if printed:
            error += f"; the terminal printed: {printed[-2000:]}"
        with contextlib.suppress(Exception):
            log = self.sandbox.download(f"{self._cwd}/{HOST_DIR}/host.log").decode(errors="replace").strip()
            if log:
                error += "; the end of its log: " + " | ".join(log.splitlines()[-_START_LOG_LINES:])
        return error

    @classmethod
    def open(cls, client: SandboxClient, *, image: str = "host", cpu: str | None = None, memory: str | None = None,
             block_network: bool = True, **kwargs: Any) -> BrowserSession:
        """Create a sandbox for one browser and start it; the session deletes the sandbox on `close()`.

        ``cpu`` / ``memory`` (Kubernetes quantities) default to `browser_resources` of the service's backend."""
        if cpu is None or memory is None:
            defaults = browser_resources(str(client.health().get("backend")))
            cpu = defaults.get("cpu") if cpu is None else cpu
            memory = defaults["memory"] if memory is None else memory
        sandbox = client.create(image, block_network=block_network, cpu=cpu, memory=memory)
        try:
            return cls(sandbox, own_sandbox=True, **kwargs)
        except BaseException:
            sandbox.delete()
            raise

    @staticmethod
    def url(path: str = "/") -> str:
        """The address of a site page inside the sandbox, e.g. `url("/shop/")`."""
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"path must start with '/', got {path!r}")
        return f"{SITE_ORIGIN}{path}"

    # -- requests -------------------------------------------------------------------------------------------

    def _receive(self, timeout: float) -> dict[str, Any]:
        """The next answer frame, its payload (if any) as bytes under "payload"; everything else on the terminal
        (there should be nothing) is skipped."""
        mark = _host.FRAME_MARK.encode()
        deadline = time.monotonic() + timeout
        while True:
            start = self._buffer.find(mark)
            end = self._buffer.find(b"\n", start) if start >= 0 else -1
            if end >= 0:
                frame = json.loads(self._buffer[start + len(mark):end])
                if "payload_file" in frame:
                    self._buffer = self._buffer[end + 1:]
                    return self._payload_file(frame)
                size = frame.get("payload", 0)
                if len(self._buffer) > end + size:
                    frame["payload"] = self._buffer[end + 1:end + 1 + size]
                    self._buffer = self._buffer[end + 1 + size:]
                    return frame
            left = deadline - time.monotonic()
            if left <= 0:
                return {"env_error": f"the browser host did not answer within {timeout:g}s"}
            try:
                chunk = self._pty.read(left)
            except SandboxError:
                continue  # the deadline check above ends the wait
            if not chunk:
                return {"env_error": f"the browser host exited (code {self._pty.returncode}, "
                                     f"{self._pty.error or 'no error'})"}
            self._buffer += chunk

    def _payload_file(self, frame: dict[str, Any]) -> dict[str, Any]:
        """The frame with its payload read from the file the host wrote it to (a large screenshot)."""
        path = frame.pop("payload_file")
        try:
            payload = self.sandbox.download(path if path.startswith("/") else f"{self._cwd}/{path}")
        except SandboxError as exc:
            return {"env_error": f"cannot read the browser's screenshot {path}: {exc}"}
        if len(payload) != frame["payload"]:
            return {"env_error": f"the browser's screenshot {path} has {len(payload)} bytes, not {frame['payload']}"}
        return {**frame, "payload": payload}

    def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.closed:
            raise ValueError("the session is closed")
        if self.env_error is not None:
            return {"env_error": self.env_error}
        try:
            self._pty.write(json.dumps(request) + "\n")
        except Exception as exc:
            self.env_error = f"cannot reach the browser host: {type(exc).__name__}: {exc}"
            return {"env_error": self.env_error}
        answer = self._receive(self.step_timeout)
        if answer.get("env_error"):
            self.env_error = answer["env_error"]
        return answer

    def _observation(self, answer: dict[str, Any]) -> Observation:
        if answer.get("env_error") or "observation" not in answer:
            return Observation(b"", self.viewport, (), 0,
                               env_error=answer.get("env_error") or answer.get("error") or "no observation")
        obs = answer["observation"]
        return Observation(screenshot=answer["payload"], viewport=tuple(obs["viewport"]),
                           tabs=tuple((t["url"], t["title"]) for t in obs["tabs"]), active=int(obs["active"]),
                           text=obs.get("text"), error=obs.get("error"))

    # -- the API --------------------------------------------------------------------------------------------

    def reset(self, url: str, *, text_view: bool | None = None, screenshot: bool | None = None,
              fresh_state: bool = False) -> Observation:
        """Close every tab but the first and open `url` in it (a task's start URL). With `fresh_state` the sites
        forget what earlier visitors changed first (cart, orders, bookings, settings, captcha hits): one task
        attempt's `site_state()` then shows only what that attempt did. `text_view` and `screenshot` (None: the
        session's defaults) say what the observation holds, as in `step`."""
        if not isinstance(url, str) or not url:
            raise ValueError(f"url must be a non-empty string, got {url!r}")
        return self._observation(self._request({"op": "reset", "url": url, **self._views(text_view, screenshot),
                                                "fresh_state": bool(fresh_state)}))

    def observe(self, *, text_view: bool | None = None, screenshot: bool | None = None) -> Observation:
        """The current observation, without acting."""
        return self._observation(self._request({"op": "observe", **self._views(text_view, screenshot)}))

    def step(self, name: str, arguments: dict[str, Any] | None = None, *, text_view: bool | None = None,
             screenshot: bool | None = None) -> Observation:
        """Run one tool call and observe. An invalid call gives an observation with `error`; a gone browser
        one with `env_error` (and every later step the same). `done` acts on nothing: the caller ends the
        episode with its response. `text_view` / `screenshot`: add the text view / take the screenshot (None:
        the session's `text_view` / `screenshots`); without the screenshot, `Observation.screenshot` is b""."""
        answer = self._request({"op": "tool", "name": name, "arguments": arguments if arguments is not None
                                else {}, **self._views(text_view, screenshot)})
        return self._observation(answer)

    def site_state(self) -> dict[str, Any]:
        """What the agent changed on the sites (cart, orders, bookings, settings), from the sites themselves.

        Raises:
            SandboxError: the host is gone (the state went with it).
        """
        answer = self._request({"op": "state"})
        if "state" not in answer:
            raise SandboxError(f"no site state: {answer.get('env_error') or answer}")
        return answer["state"]

    def _views(self, text_view: bool | None, screenshot: bool | None) -> dict[str, bool]:
        for name, value in (("text_view", text_view), ("screenshot", screenshot)):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool or None, got {value!r}")
        return {"text_view": self.text_view if text_view is None else text_view,
                "screenshot": self.screenshots if screenshot is None else screenshot}

    def close(self) -> None:
        """End the browser (and delete the sandbox when the session owns it). Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.env_error is None:
            with contextlib.suppress(Exception):
                self._pty.write(json.dumps({"op": "close"}) + "\n")
                self._receive(5.0)
        with contextlib.suppress(Exception):
            self._pty.close()
        if self.own_sandbox:
            self.sandbox.delete()

    def __enter__(self) -> BrowserSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

