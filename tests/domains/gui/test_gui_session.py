"""The browser host's answer frames as `BrowserSession` reads them off the terminal, its start failures, where it
finds the sandbox's Playwright, and its jail's binds (no browser needed)."""

import json
import sys

import pytest

from orchard.domains.gui import BrowserSession
from orchard.domains.gui._host import FRAME_MARK, INLINE_PAYLOAD_MAX, frame_bytes
from orchard.domains.gui.session import (
    PLAYWRIGHT_PATH_ENV,
    PLAYWRIGHT_PATH_RECORD,
    browser_jail,
    default_playwright_path,
)
from orchard.env import NotFoundError, SandboxError


class ScriptedPty:
    """A terminal that hands out `data` in pieces of `piece` bytes and records what is written to it."""

    def __init__(self, data: bytes, piece: int) -> None:
        self.chunks = [data[i:i + piece] for i in range(0, len(data), piece)]
        self.written: list[dict] = []
        self.returncode, self.error = None, None

    def read(self, timeout: float) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""

    def write(self, data: str) -> None:
        self.written.append(json.loads(data))

    def close(self) -> None:
        pass


class ScriptedSandbox:
    sandbox_id, info = "scripted", {}

    def __init__(self, terminal: bytes, piece: int, files: dict[str, bytes] | None = None) -> None:
        self.terminal, self.piece, self.files = terminal, piece, files or {}

    def download(self, path: str) -> bytes:
        if path not in self.files:
            raise NotFoundError(f"no file {path}")
        return self.files[path]

    def upload(self, path: str, content: str) -> None:
        pass

    def pty(self, command: str) -> ScriptedPty:
        return ScriptedPty(self.terminal, self.piece)


def _observation(url: str) -> dict:
    return {"observation": {"tabs": [{"url": url, "title": "T"}], "active": 0, "viewport": [4, 3], "text": None,
                            "error": None}}


def test_the_screenshot_crosses_the_terminal_raw_after_its_json_line():
    # a PNG-like payload that holds what a reader could mistake for a frame: a newline and the frame mark
    png_a = b"\x89PNG\r\n\x1a\n" + FRAME_MARK.encode() + b'{"observation": 1}\n' + bytes(range(256))
    png_b = b"\n\n" + FRAME_MARK.encode()
    terminal = (b"login noise\r\n" + frame_bytes({"hello": True, "uid": 1234})
                + frame_bytes(_observation("http://a/"), png_a) + frame_bytes(_observation("http://b/"), png_b)
                + frame_bytes({"closed": True}))
    # the raw payload, not base64: the frame is the JSON line plus exactly len(png_a) bytes (base64 would be
    # 4 * ceil(291 / 3) = 388 bytes for these 291)
    assert len(frame_bytes(_observation("http://a/"), png_a)) == len(
        (FRAME_MARK + json.dumps({**_observation("http://a/"), "payload": len(png_a)}) + "\n").encode()) + len(png_a)
    for piece in (1, 7, 4095, len(terminal)):  # one byte at a time, odd pieces, the terminal's reads, all at once
        session = BrowserSession(ScriptedSandbox(terminal, piece), playwright_path=None)
        assert session.uid == 1234
        first, second = session.observe(), session.observe()
        assert (first.screenshot, first.tabs, first.viewport) == (png_a, (("http://a/", "T"),), (4, 3))
        assert (second.screenshot, second.tabs) == (png_b, (("http://b/", "T"),))
        assert first.env_error is None and second.env_error is None
        assert [w["op"] for w in session._pty.written] == ["observe", "observe"]
        session.close()


def test_a_screenshot_over_the_inline_limit_is_downloaded_from_the_file_its_frame_names():
    big = bytes(range(256)) * (INLINE_PAYLOAD_MAX // 256 + 1)  # 65 792 bytes: 256 over the limit
    named = {**_observation("http://big/"), "payload": len(big), "payload_file": ".orchard-gui/screenshot.png"}
    terminal = frame_bytes({"hello": True}) + frame_bytes(named) + frame_bytes(named) + frame_bytes(named)
    # the relative name is the host's, in the sandbox's working directory (/workspace by default)
    files = {"/workspace/.orchard-gui/screenshot.png": big}
    session = BrowserSession(ScriptedSandbox(terminal, 4095, files), playwright_path=None)
    obs = session.observe()
    assert obs.screenshot == big and obs.tabs == (("http://big/", "T"),) and obs.env_error is None
    files["/workspace/.orchard-gui/screenshot.png"] = big[:-1]  # a file that is not what the frame says
    assert "65791 bytes, not 65792" in session.observe().env_error
    session.env_error = None
    del files["/workspace/.orchard-gui/screenshot.png"]  # a file that is gone
    assert "cannot read the browser's screenshot" in session.observe().env_error


def test_a_failed_start_says_why_with_what_the_terminal_printed_and_the_host_log():
    # the host died before its first frame (a broken jail, an import error): the terminal's own words and the
    # end of the host's log are the cause, not only "the browser host exited"
    log = "\n".join(f"line {i}" for i in range(30)) + "\nRuntimeError: the sites are broken\n"
    files = {"/workspace/.orchard-gui/host.log": log.encode()}
    sandbox = ScriptedSandbox(b"bwrap: Can't find source path /nowhere: No such file or directory\r\n", 4095, files)
    with pytest.raises(SandboxError) as raised:
        BrowserSession(sandbox, playwright_path=None)
    message = str(raised.value)
    assert "the browser host exited" in message
    assert "the terminal printed: bwrap: Can't find source path /nowhere" in message
    # the last 20 lines of the log: line 10 onwards (30 numbered lines and the error: 31 lines)
    assert "RuntimeError: the sites are broken" in message and "line 11" in message and "line 10 " not in message


def test_the_sandbox_playwright_is_found_where_setup_recorded_it(tmp_path, monkeypatch):
    site = tmp_path / "gui-site"
    (site / "playwright").mkdir(parents=True)
    monkeypatch.delenv(PLAYWRIGHT_PATH_ENV, raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    (tmp_path / PLAYWRIGHT_PATH_RECORD).write_text(f"{site}\n")
    assert default_playwright_path() == str(site)
    monkeypatch.setenv(PLAYWRIGHT_PATH_ENV, "/elsewhere")  # the variable, when set, wins
    assert default_playwright_path() == "/elsewhere"
    monkeypatch.delenv(PLAYWRIGHT_PATH_ENV)
    (site / "playwright").rmdir()  # a record whose folder lost Playwright is passed over
    assert default_playwright_path() != str(site)


def test_screenshots_are_asked_per_call_or_by_the_session_default():
    terminal = frame_bytes({"hello": True}) + frame_bytes(_observation("http://a/")) * 3
    session = BrowserSession(ScriptedSandbox(terminal, 4095), playwright_path=None, screenshots=False)
    obs = session.observe()
    assert obs.screenshot == b"" and obs.env_error is None  # no payload: an empty screenshot
    session.step("click", {"x": 1, "y": 1}, screenshot=True)
    session.reset("http://a/", text_view=True)
    assert [(w["screenshot"], w["text_view"]) for w in session._pty.written] == [(False, False), (True, False),
                                                                                  (False, True)]
    with pytest.raises(ValueError, match="screenshot must be a bool or None, got 1"):
        session.observe(screenshot=1)
    with pytest.raises(ValueError, match="screenshots must be a bool"):
        BrowserSession(ScriptedSandbox(terminal, 4095), playwright_path=None, screenshots="no")
    with pytest.raises(ValueError, match="playwright_path must be an absolute path"):
        BrowserSession(ScriptedSandbox(terminal, 4095), playwright_path="site-packages")


def test_the_jail_binds_only_what_the_browser_needs():
    argv = browser_jail("/workspace", "/opt/orchard/gui-site")
    assert argv[0] == "bwrap" and argv[-1] == "--"
    binds = [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a in ("--bind", "--ro-bind", "--ro-bind-try",
                                                                        "--dev-bind")]
    assert ("/opt/orchard/gui-site", "/opt/orchard/gui-site") in binds
    assert ("/workspace/.orchard-gui", "/workspace/.orchard-gui") in binds  # the host's folder, not the workspace
    assert {src for src, _ in binds} == {"/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                                        "/opt/orchard/gui-site", "/proc", "/dev", "/workspace/.orchard-gui"}
    assert "--unshare-net" not in argv  # the network is the sandbox's to choose
    for bad in ("workspace", None):
        with pytest.raises(ValueError, match="workdir must be an absolute path"):
            browser_jail(bad, None)
