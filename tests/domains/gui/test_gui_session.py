"""The browser host's answer frames as `BrowserSession` reads them off the terminal (no browser needed)."""

import json

from orchard.domains.gui import BrowserSession
from orchard.domains.gui._host import FRAME_MARK, INLINE_PAYLOAD_MAX, frame_bytes
from orchard.env import NotFoundError


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
