"""The tool schemas, observations as chat content and the last-k-images rule (no browser needed)."""

import pytest

from orchard.domains.gui import GUI_TOOL_NAMES, GUI_TOOLS, IMAGE_PLACEHOLDER, Observation, keep_last_images
from orchard.domains.gui._host import TOOL_ARGS


def test_thirteen_tools_and_the_host_takes_the_schemas_arguments():
    assert GUI_TOOL_NAMES == ("click", "hover", "drag", "write", "press_keys", "scroll", "goto_url", "go_back",
                              "wait", "new_tab", "switch_tab", "close_tab", "done")
    for tool in GUI_TOOLS:
        fn = tool["function"]
        required, optional = TOOL_ARGS[fn["name"]]
        assert tuple(fn["parameters"]["required"]) == required
        assert set(fn["parameters"]["properties"]) == set(required) | set(optional)
    scroll = next(t for t in GUI_TOOLS if t["function"]["name"] == "scroll")["function"]["parameters"]
    assert scroll["properties"]["amount"]["minimum"] == 0.0 and scroll["properties"]["amount"]["maximum"] == 1.0


def _obs_message(i: int) -> dict:
    return {"role": "tool", "content": Observation(f"png{i}".encode(), (4, 3), (("u", "t"),), 0).to_content()}


def test_keep_last_images_keeps_the_last_k_and_every_text():
    messages = [{"role": "user", "content": "task"}] + [_obs_message(i) for i in range(4)]
    kept = keep_last_images(messages, k=2)
    # 4 images, k = 2: the first two (messages 1 and 2) become placeholders, messages 3 and 4 keep theirs
    assert [m["content"][1].get("text") for m in kept[1:]] == [IMAGE_PLACEHOLDER, IMAGE_PLACEHOLDER, None, None]
    assert [m["content"][0] for m in kept[1:]] == [m["content"][0] for m in messages[1:]]
    assert kept[0] == messages[0] and messages[1]["content"][1]["type"] == "image_url"  # the input is not changed
    assert keep_last_images(messages, k=10) == messages
    assert all(len(m["content"]) == 1 or m["content"][1]["type"] == "text" for m in keep_last_images(messages, 0)[1:])
    with pytest.raises(ValueError, match="k must be an int >= 0, got -1"):
        keep_last_images(messages, k=-1)


def test_observation_text_lists_errors_tabs_and_the_text_view():
    obs = Observation(b"", (1280, 720), (("http://a/", "A"), ("http://b/", "B")), 1, text="[button] \"Go\" @(5,6)",
                      error="bad")
    assert obs.describe() == ("Error: bad\nViewport: 1280x720\nTab 0: 'A' http://a/\nTab 1 (active): 'B' http://b/\n"
                              "Page elements (role, name, centre):\n[button] \"Go\" @(5,6)")
    assert obs.to_content() == [{"type": "text", "text": obs.describe()}]  # no screenshot, no image part
