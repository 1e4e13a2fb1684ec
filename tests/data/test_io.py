import gzip
import json
import math

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchard.data import (
    Message,
    RenderedSample,
    RenderReport,
    ToolCall,
    Trajectory,
    from_hf_dataset,
    iter_jsonl,
    read_jsonl,
    read_parquet,
    render_trajectory,
    table_to_trajectories,
    to_hf_dataset,
    to_prompt_dataset,
    to_token_dataset,
    trajectories_to_table,
    write_jsonl,
    write_parquet,
)

from .strategies import trajectories
from .test_schema import _example


def _batch() -> list[Trajectory]:
    malformed = _example()
    malformed.messages[2].tool_calls[1].arguments = '{"command": "pw'  # a format error is kept verbatim
    malformed.termination_reason = "format_error"
    return [
        _example(),
        malformed,
        Trajectory(
            messages=[{"role": "user", "content": 'só 中文 🙂\n\t"q"'}],
            reward=None,
            termination_reason="env_error",
        ),
        Trajectory(),
    ]


def _same(a: list[Trajectory], b: list[Trajectory]) -> None:
    assert a == b
    assert [t.to_json() for t in a] == [t.to_json() for t in b]  # also float bits, -0.0, key order


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_jsonl_round_trip(tmp_path, name):
    path = tmp_path / name
    trajs = _batch()
    assert write_jsonl(trajs[:2], path) == 2
    assert write_jsonl(trajs[2:], path, append=True) == 2
    _same(read_jsonl(path), trajs)
    _same(list(iter_jsonl(str(path))), trajs)
    if name.endswith(".gz"):
        with gzip.open(path, "rt") as f:
            assert len(f.read().splitlines()) == 4


def test_jsonl_bad_line_names_line(tmp_path):
    path = tmp_path / "t.jsonl"
    write_jsonl(_batch()[:1], path)
    with open(path, "a") as f:
        f.write("\n")  # blank lines are skipped
        f.write(json.dumps({"messages": [{"role": "robot"}]}) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl:3: not a trajectory.*Message.role"):
        read_jsonl(path)


def test_parquet_round_trip_and_columns(tmp_path):
    path = tmp_path / "t.parquet"
    trajs = _batch()
    assert write_parquet(trajs, path) == 4
    _same(read_parquet(path), trajs)
    table = pq.read_table(path)
    # Scalar columns are native, so a dataset can be filtered without parsing JSON.
    assert table.column("reward").to_pylist() == [0.1 + 0.2, 0.1 + 0.2, None, None]
    assert table.column("termination_reason").to_pylist() == [
        "step_budget",
        "format_error",
        "env_error",
        "done",
    ]
    assert table.column("num_steps").to_pylist() == [2, 2, 0, 0]
    empty = tmp_path / "empty.parquet"
    assert write_parquet([], empty) == 0
    assert read_parquet(empty) == []


def test_hf_datasets_round_trip(tmp_path):
    trajs = _batch()
    ds = to_hf_dataset(trajs)
    assert isinstance(ds, datasets.Dataset) and len(ds) == 4
    _same(from_hf_dataset(ds), trajs)
    # Filtering on native columns keeps rows intact.
    kept = ds.filter(lambda r: r["termination_reason"] != "env_error")
    _same(from_hf_dataset(kept), [t for t in trajs if not t.is_env_error])
    # A parquet file written by write_parquet loads as a dataset too.
    write_parquet(trajs, tmp_path / "t.parquet")
    loaded = datasets.Dataset.from_parquet(str(tmp_path / "t.parquet"), cache_dir=str(tmp_path / "cache"))
    _same(from_hf_dataset(loaded), trajs)


def _text_only() -> list[Trajectory]:
    """Trajectories in which no message calls a tool: a text harness's episodes, plain chat."""
    return [
        Trajectory(messages=[{"role": "user", "content": "2+2?"},
                             {"role": "assistant", "content": "<answer>4</answer>", "token_ids": [9, 2],
                              "logprobs": [-0.5, -0.125]}],
                   reward=1.0, task_id="math-1", metadata={"harness": "text"}),
        Trajectory(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                             {"role": "assistant", "content": "hello"}]),
        Trajectory(),
    ]


_KINDS = {
    "text_only": _text_only,
    "tool_calls_only": lambda: _batch()[:2],
    "mixed": lambda: [_batch()[0], *_text_only(), _batch()[1]],
}


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_datasets_save_and_load_round_trip(kind, tmp_path):
    trajs = _KINDS[kind]()
    cache = str(tmp_path / "cache")
    ds = to_hf_dataset(trajs)
    ds.save_to_disk(str(tmp_path / "saved"))
    _same(from_hf_dataset(datasets.load_from_disk(str(tmp_path / "saved"))), trajs)
    ds.to_parquet(str(tmp_path / "exported.parquet"))
    _same(read_parquet(tmp_path / "exported.parquet"), trajs)
    loaded = datasets.load_dataset("parquet", data_files=str(tmp_path / "exported.parquet"), split="train",
                                   cache_dir=cache)
    _same(from_hf_dataset(loaded), trajs)
    # A file of ours, loaded by datasets, saves again both ways.
    write_parquet(trajs, tmp_path / "ours.parquet")
    loaded = datasets.load_dataset("parquet", data_files=str(tmp_path / "ours.parquet"), split="train",
                                   cache_dir=cache)
    loaded.save_to_disk(str(tmp_path / "resaved"))
    _same(from_hf_dataset(datasets.load_from_disk(str(tmp_path / "resaved"))), trajs)
    loaded.to_parquet(str(tmp_path / "reexported.parquet"))
    _same(read_parquet(tmp_path / "reexported.parquet"), trajs)


def test_datasets_save_when_one_chunk_has_no_tool_calls(tmp_path):
    # Concatenated datasets keep one arrow chunk each: the first holds no tool call at all, the second does.
    text, calls = _text_only(), _batch()[:2]
    ds = datasets.concatenate_datasets([to_hf_dataset(text), to_hf_dataset(calls)])
    assert ds.data.column("messages").num_chunks == 2
    ds.save_to_disk(str(tmp_path / "saved"))
    _same(from_hf_dataset(datasets.load_from_disk(str(tmp_path / "saved"))), text + calls)
    ds.to_parquet(str(tmp_path / "t.parquet"))
    _same(read_parquet(tmp_path / "t.parquet"), text + calls)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(trajectories(), max_size=3))
def test_round_trip_property_all_formats(tmp_path, trajs):
    write_jsonl(trajs, tmp_path / "p.jsonl")
    _same(read_jsonl(tmp_path / "p.jsonl"), trajs)
    _same(table_to_trajectories(trajectories_to_table(trajs)), trajs)
    write_parquet(trajs, tmp_path / "p.parquet")
    _same(read_parquet(tmp_path / "p.parquet"), trajs)
    _same(from_hf_dataset(to_hf_dataset(trajs)), trajs)


def test_io_validation(tmp_path):
    with pytest.raises(ValueError, match="trajs must be an iterable of Trajectory"):
        write_jsonl(_example(), tmp_path / "x.jsonl")
    with pytest.raises(ValueError, match=r"trajs\[1\] must be a Trajectory"):
        write_parquet([_example(), {"messages": []}], tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="path must be a str"):
        read_jsonl(3)
    with pytest.raises(ValueError, match=r"datasets\.Dataset"):
        from_hf_dataset([{"messages": "[]"}])
    with pytest.raises(ValueError, match="'metadata' is not JSON-serialisable"):
        write_parquet([Trajectory(metadata={"s": {1, 2}})], tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="row 0: no 'messages' column"):
        from_hf_dataset(datasets.Dataset.from_dict({"text": ["The sky is blue."]}))
    with pytest.raises(ValueError, match="row 0: column 'messages' holds a string that is not JSON"):
        from_hf_dataset(datasets.Dataset.from_dict({"messages": ["hello"]}))
    with pytest.raises(ValueError, match=r"row 0: messages\[0\]: Message\.role"):
        from_hf_dataset(datasets.Dataset.from_list([{"messages": [{"role": "robot", "content": "x"}]}]))
    with pytest.raises(ValueError, match="'prompt' and 'completion' must be lists of messages"):
        from_hf_dataset(datasets.Dataset.from_dict({"prompt": ["The sky is"], "completion": [" blue."]}))


def test_layout_is_trls_conversational_format(tokenizer):
    trajs = _batch()
    ds = to_hf_dataset(trajs)
    schema = trajectories_to_table(trajs).schema
    assert pa.types.is_list(schema.field("messages").type) and isinstance(schema.field("metadata").type, pa.JsonType)
    row = ds[0]  # what TRL sees: datasets decodes the json fields
    call_dict, call_str = row["messages"][2]["tool_calls"]
    # Arguments are a dict wherever they are a JSON object, as chat templates want; a string keeps its exact text.
    # A call given as a dict is exactly OpenAI's shape; arguments_text appears only where the call gave a string.
    assert call_dict == {"id": "c1", "type": "function", "function": {"name": "exec", "arguments": {"command": "ls"}}}
    assert call_str["function"] == {
        "name": "exec", "arguments": {"command": "pwd"}, "arguments_text": '{"command": "pwd"}'
    }
    malformed = ds[1]["messages"][2]["tool_calls"][1]["function"]
    assert malformed["arguments"] == malformed["arguments_text"] == '{"command": "pw'
    assert row["messages"][0]["token_ids"] is None and row["messages"][2]["token_ids"] == [5, 6, 2]
    assert row["tools"] == trajs[0].tools
    # A chat template renders the dataset row exactly as it renders the trajectory.
    for traj, r in zip(trajs[:3], ds, strict=False):
        assert tokenizer.apply_chat_template(r["messages"], tools=r["tools"] or None, tokenize=False) == (
            tokenizer.apply_chat_template(traj.openai_messages(), tools=traj.tools or None, tokenize=False)
        )


def test_content_parts_round_trip():
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:x"}}]
    trajs = [Trajectory(messages=[{"role": "user", "content": parts}, {"role": "assistant", "content": "ok"}])]
    _same(from_hf_dataset(to_hf_dataset(trajs)), trajs)
    row = to_hf_dataset(trajs)[0]["messages"][0]
    assert row["content"] is None and row["content_parts"] == parts


_TRL_TOOLS = [
    {"type": "function", "function": {"name": "control_light", "description": "Switch a light.",
                                      "parameters": {"type": "object", "properties": {"room": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time.",
                                      "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}},
]


def _trl_rows(arguments_as_text: bool) -> list[dict]:
    """Two rows in TRL's tool-calling format: no tool-call ids, tool messages answer by name."""

    def call(name: str, arguments: dict) -> dict:
        return {"type": "function", "function": {"name": name,
                                                 "arguments": json.dumps(arguments) if arguments_as_text else arguments}}

    return [
        {"messages": [{"role": "user", "content": "Lights on."},
                      {"role": "assistant", "tool_calls": [call("control_light", {"room": "hall"})]},
                      {"role": "tool", "name": "control_light", "content": "on"},
                      {"role": "assistant", "content": "Done."}],
         "tools": _TRL_TOOLS},
        {"messages": [{"role": "user", "content": "Time?"},
                      {"role": "assistant", "tool_calls": [call("get_time", {"tz": "UTC"})]},
                      {"role": "tool", "name": "get_time", "content": "12:00"}],
         "tools": _TRL_TOOLS},
    ]


@pytest.mark.parametrize("arguments_as_text", [False, True])
@pytest.mark.parametrize("tools_as_text", [False, True])
def test_reads_trl_datasets_as_they_are(arguments_as_text, tools_as_text, tmp_path):
    rows = _trl_rows(arguments_as_text)
    if tools_as_text:
        rows = [dict(r, tools=json.dumps(r["tools"])) for r in rows]
    ds = datasets.Dataset.from_list(rows)
    if not arguments_as_text:
        # Arrow gives both calls' arguments one struct type {room, tz}: each row holds the other key as null.
        assert ds[0]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"room": "hall", "tz": None}
    got = from_hf_dataset(ds)
    args = ['{"room": "hall"}', '{"tz": "UTC"}'] if arguments_as_text else [{"room": "hall"}, {"tz": "UTC"}]
    assert got[0].messages == [
        Message(role="user", content="Lights on."),
        Message(role="assistant", tool_calls=[ToolCall(name="control_light", arguments=args[0])]),
        Message(role="tool", name="control_light", content="on"),
        Message(role="assistant", content="Done."),
    ]
    assert got[1].messages[1].tool_calls == [ToolCall(name="get_time", arguments=args[1])]
    # Tool schemas lose the struct-union nulls too: control_light's properties do not gain get_time's "tz".
    assert got[0].tools == got[1].tools == _TRL_TOOLS
    assert got[0].reward is None and got[0].termination_reason == "done"  # our columns are optional
    # What we write from them reads back the same, through parquet too.
    write_parquet(got, tmp_path / "t.parquet")
    _same(read_parquet(tmp_path / "t.parquet"), got)


def test_reads_trl_prompt_completion():
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "Sky?"}],
                                      "completion": [{"role": "assistant", "content": "Blue."}]}])
    assert from_hf_dataset(ds) == [Trajectory(messages=[{"role": "user", "content": "Sky?"},
                                                        {"role": "assistant", "content": "Blue."}])]


def _orchard_0_1_table(trajs: list[Trajectory]) -> pa.Table:
    """What write_parquet / to_hf_dataset wrote before the nested layout: nested fields as JSON text columns."""
    text = ("messages", "tools", "reward_components", "metadata")
    schema = pa.schema([("task_id", pa.string()), ("group_id", pa.string()), ("reward", pa.float64()),
                        ("termination_reason", pa.string()), ("num_steps", pa.int64()),
                        *[(name, pa.string()) for name in text]])
    rows = [{**{k: d[k] for k in ("task_id", "group_id", "reward", "termination_reason")}, "num_steps": t.num_steps,
             **{k: json.dumps(d[k]) for k in text}} for t, d in ((t, t.to_dict()) for t in trajs)]
    return pa.Table.from_pylist(rows, schema=schema)


def test_reads_orchard_0_1_json_text_layout(tmp_path):
    trajs = _batch()
    pq.write_table(_orchard_0_1_table(trajs), tmp_path / "old.parquet")
    _same(read_parquet(tmp_path / "old.parquet"), trajs)
    _same(from_hf_dataset(datasets.Dataset(_orchard_0_1_table(trajs))), trajs)


def _struct_tool_calls_schema(json_type: pa.DataType) -> pa.Schema:
    function = pa.struct([("name", pa.string()), ("arguments", json_type), ("arguments_text", pa.string())])
    call = pa.struct([("id", pa.string()), ("type", pa.string()), ("function", function)])
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("content_parts", json_type),
                         ("tool_calls", pa.list_(call)), ("tool_call_id", pa.string()), ("name", pa.string()),
                         ("token_ids", pa.list_(pa.int64())), ("logprobs", pa.list_(pa.float64()))])
    return pa.schema([("messages", pa.list_(message)), ("tools", pa.list_(json_type)), ("task_id", pa.string()),
                      ("group_id", pa.string()), ("reward", pa.float64()), ("termination_reason", pa.string()),
                      ("num_steps", pa.int64()), ("reward_components", json_type), ("metadata", json_type)])


def _struct_tool_calls_table(trajs: list[Trajectory]) -> pa.Table:
    """What write_parquet / to_hf_dataset wrote before a tool call became one json value: tool_calls as
    list<struct<id, type, function: struct<name, arguments: json, arguments_text: string>>>."""
    rows = trajectories_to_table(trajs).to_pylist()  # json values as their text
    for m in (m for row in rows for m in row["messages"] if m["tool_calls"] is not None):
        m["tool_calls"] = [json.loads(c) for c in m["tool_calls"]]
        for fn in (c["function"] for c in m["tool_calls"]):
            fn["arguments"], fn["arguments_text"] = json.dumps(fn["arguments"]), fn.get("arguments_text")
    table = pa.Table.from_pylist(rows, schema=_struct_tool_calls_schema(pa.string()))
    return table.cast(_struct_tool_calls_schema(pa.json_()))


def test_reads_struct_tool_calls_layout(tmp_path):
    trajs = _batch()
    old = _struct_tool_calls_table(trajs)
    assert pa.types.is_struct(old.schema.field("messages").type.value_type.field("tool_calls").type.value_type)
    pq.write_table(old, tmp_path / "old.parquet")
    _same(read_parquet(tmp_path / "old.parquet"), trajs)
    _same(from_hf_dataset(datasets.Dataset(old)), trajs)


def _float_trajectories() -> list[Trajectory]:
    logprobs = [-1.2345678901234567e-05, -1.0 / 3.0, -0.0, -5e-324, -745.1332191019411]
    return [
        Trajectory(messages=[{"role": "user", "content": "q"},
                             {"role": "assistant", "content": "a", "token_ids": [1, 2, 3, 4, 5], "logprobs": logprobs}],
                   reward=0.1 + 0.2, reward_components={"tests": 1.0, "length": -1e-300}, metadata={"n": 1, "x": 2.0}),
        Trajectory(messages=[{"role": "user", "content": "q"}], reward=1.0, metadata={}),
    ]


def test_floats_through_jsonl_readers(tmp_path):
    trajs = _float_trajectories()
    path = tmp_path / "f.jsonl"
    write_jsonl(trajs, path)
    line = path.read_text().splitlines()[0]
    # Floats are written as the shortest repr that parses back to the same double (the literal ...567e-05 and
    # ...568e-05 are one double; repr picks ...568); ints stay ints.
    assert '"logprobs": [-1.2345678901234568e-05, -0.3333333333333333, -0.0, -5e-324, -745.1332191019411]' in line
    assert '"reward": 0.30000000000000004' in line and '"metadata": {"n": 1, "x": 2.0}' in line
    # Our reader: bit for bit (-0.0 keeps its sign, the subnormal 5e-324 survives).
    _same(read_jsonl(path), trajs)
    # datasets' JSON loader re-encodes a batch with pandas' ujson at 10 decimals once any field is mixed (messages
    # with different keys always are): each float is then off by up to 0.5e-10 (-1.2345678901234567e-05 reads as
    # -1.23457e-05), and -0.0 and 5e-324 read as 0.0. The docs say to load JSONL with read_jsonl, or parquet.
    loaded = from_hf_dataset(
        datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "cache"))
    )
    assert [t.openai_messages() for t in loaded] == [t.openai_messages() for t in trajs]
    assert loaded[0].messages[1].logprobs == pytest.approx(trajs[0].messages[1].logprobs, rel=0, abs=0.5e-10)
    assert loaded[0].reward == pytest.approx(0.3, rel=0, abs=0.5e-10)
    # The exact route to a datasets.Dataset: parquet, whose logprobs and rewards are native float64 columns.
    write_parquet(trajs, tmp_path / "f.parquet")
    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "f.parquet"), split="train",
                               cache_dir=str(tmp_path / "cache"))
    assert ds[0]["messages"][1]["logprobs"] == trajs[0].messages[1].logprobs
    assert [math.copysign(1.0, x) for x in ds[0]["messages"][1]["logprobs"]] == [-1.0] * 5
    assert ds["reward"] == [0.1 + 0.2, 1.0]
    _same(from_hf_dataset(ds), trajs)


def _sample(ids: list[int], action: list[bool], **kw) -> RenderedSample:
    n = len(ids)
    return RenderedSample(
        input_ids=torch.tensor(ids),
        action_mask=torch.tensor(action),
        turn_index=torch.full((n,), -1),
        old_logprobs=torch.zeros(n),
        logprob_mask=torch.zeros(n, dtype=torch.bool),
        report=RenderReport(),
        **kw,
    )


TOKEN_COLUMNS = ["input_ids", "attention_mask", "labels", "completion_mask", "assistant_masks"]


def test_token_dataset_by_hand():
    # ids 5..9, the policy generated 7 and 8: only they are labels, the rest -100.
    ds = to_token_dataset([_sample([5, 6, 7, 8, 9], [False, False, True, True, False]), _sample([3], [True])])
    assert ds.column_names == TOKEN_COLUMNS and ds.num_rows == 2
    assert ds[0] == {
        "input_ids": [5, 6, 7, 8, 9],
        "attention_mask": [1, 1, 1, 1, 1],
        "labels": [-100, -100, 7, 8, -100],
        "completion_mask": [0, 0, 1, 1, 0],
        "assistant_masks": [0, 0, 1, 1, 0],
    }
    assert ds[1]["labels"] == [3] and ds[1]["assistant_masks"] == [1]


def test_token_dataset_trains_what_we_train_and_what_the_template_marks(tokenizer):
    trajs = [_example(), _example()]
    for m in trajs[1].messages:  # the SFT path: turns tokenized from their text
        m.token_ids = m.logprobs = None
    samples = [render_trajectory(t, tokenizer) for t in trajs]
    ds = to_token_dataset(samples)
    for sample, row in zip(samples, ds, strict=True):
        action = sample.action_mask.tolist()
        assert row["input_ids"] == sample.input_ids.tolist()
        assert [label != -100 for label in row["labels"]] == action
        assert [label for label in row["labels"] if label != -100] == sample.input_ids[sample.action_mask].tolist()
        assert row["completion_mask"] == row["assistant_masks"] == [int(a) for a in action]
        assert row["attention_mask"] == [1] * len(sample)
    # Without sampled ids the rendering is the template's own, and so is the mask TRL computes from the template.
    out = tokenizer.apply_chat_template(
        trajs[1].openai_messages(), tools=trajs[1].tools, tokenize=True, return_assistant_tokens_mask=True,
        return_dict=True,
    )
    assert out["input_ids"] == ds[1]["input_ids"] and out["assistant_masks"] == ds[1]["assistant_masks"]
    assert ds[0]["input_ids"] != ds[1]["input_ids"]  # the sampled ids were spliced in


def test_token_dataset_empty_and_invalid():
    empty = to_token_dataset([])
    assert empty.num_rows == 0 and empty.column_names == TOKEN_COLUMNS
    s = _sample([1, 2], [False, True])
    with pytest.raises(ValueError, match="samples must be an iterable of RenderedSample"):
        to_token_dataset(s)
    with pytest.raises(ValueError, match="samples must be an iterable of RenderedSample"):
        to_token_dataset(3)
    with pytest.raises(ValueError, match=r"samples\[1\] must be a RenderedSample, got NoneType"):
        to_token_dataset([s, None])
    with pytest.raises(ValueError, match=r"samples\[0\] has images"):
        to_token_dataset([_sample([1], [True], pixel_values=torch.zeros(4, 3))])
    with pytest.raises(ValueError, match=r"samples\[0\]: input_ids and action_mask must both have shape \[T\]"):
        to_token_dataset([_sample([1, 2], [True])])


PROMPT_COLUMNS = ["prompt", "task_id", "data_source", "reward_model", "extra_info", "tools", "metadata"]


def test_prompt_dataset(tokenizer):
    no_system = Trajectory(messages=[{"role": "user", "content": "hi"}], task_id=None)  # no assistant turn at all
    trajs = [_example(), no_system]
    ds = to_prompt_dataset(trajs, data_source="claw")
    assert ds.column_names == PROMPT_COLUMNS and ds.num_rows == 2
    row = ds[0]
    assert row["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "list files"}]
    assert row["task_id"] == "t1" and row["data_source"] == "claw"
    assert row["reward_model"] == {"style": "rule", "ground_truth": "t1"}
    assert row["extra_info"] == {"index": 0, "task_id": "t1"}
    assert row["tools"] == trajs[0].tools and row["metadata"] == trajs[0].metadata
    assert ds[1]["prompt"] == [{"role": "user", "content": "hi"}] and ds[1]["extra_info"] == {"index": 1, "task_id": None}
    # The prompt a GRPO trainer renders is the prompt our engine saw before the first assistant turn.
    assert tokenizer.apply_chat_template(row["prompt"], tools=row["tools"], tokenize=False, add_generation_prompt=True) == (
        tokenizer.apply_chat_template(
            trajs[0].openai_messages()[:2], tools=trajs[0].tools, tokenize=False, add_generation_prompt=True
        )
    )


def test_prompt_dataset_empty_and_invalid():
    empty = to_prompt_dataset([])
    assert empty.num_rows == 0 and empty.column_names == PROMPT_COLUMNS
    with pytest.raises(ValueError, match="trajs must be an iterable of Trajectory"):
        to_prompt_dataset(_example())
    with pytest.raises(ValueError, match=r"trajs\[1\] must be a Trajectory"):
        to_prompt_dataset([_example(), {"messages": []}])
    with pytest.raises(ValueError, match="data_source must be a non-empty string"):
        to_prompt_dataset([_example()], data_source="")
    with pytest.raises(ValueError, match=r"trajs\[0\] has no message before its first assistant turn"):
        to_prompt_dataset([Trajectory(messages=[{"role": "assistant", "content": "hi"}])])
    with pytest.raises(ValueError, match=r"trajs\[0\] has no message before"):
        to_prompt_dataset([Trajectory()])
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:x"}}]
    with pytest.raises(ValueError, match=r"trajs\[0\]\.messages\[0\]: content parts"):
        to_prompt_dataset([Trajectory(messages=[{"role": "user", "content": parts}])])
