"""Trajectory IO: JSONL (optionally gzipped), parquet, and HF ``datasets``; every format round-trips exactly.

JSONL holds one :meth:`Trajectory.to_dict` per line. Parquet and ``datasets`` share one nested table layout, TRL's
conversational language-modeling layout (a ``messages`` column of chat messages with ``tool_calls``, a ``tools``
column), so ``trl.SFTTrainer`` takes :func:`to_hf_dataset` (or ``load_dataset("parquet")`` of
:func:`write_parquet` files) unchanged, plus our own columns, which TRL ignores:

=====================  ===================  =========================================================================
column                 arrow type           content
=====================  ===================  =========================================================================
``messages``           list<struct>         one struct per message, fields below
``tools``              list<json>           the tool schemas, one JSON object each
``task_id``            string               ``Trajectory.task_id`` (null allowed)
``group_id``           string               ``Trajectory.group_id`` (null allowed)
``reward``             float64              ``Trajectory.reward`` (null allowed)
``termination_reason`` string               one of ``TERMINATION_REASONS``
``num_steps``          int64                number of assistant turns (derived; ignored on read)
``reward_components``  json                 JSON object
``metadata``           json                 JSON object
=====================  ===================  =========================================================================

A message struct has the fields ``role``, ``content`` (string), ``content_parts`` (json), ``tool_calls``
(list<json>, one ``{"id", "type", "function": {"name", "arguments", "arguments_text"}}`` object per call, ``id``
and ``arguments_text`` present only when set), ``tool_call_id``, ``name``, ``token_ids`` (list<int64>) and
``logprobs`` (list<float64>). Arrow needs one type per field, where our schema allows several, so:

- an absent optional field is null (``token_ids`` / ``logprobs`` of a turn without sampled tokens, ``tool_calls`` of
  a turn without calls): chat templates test them with ``is not none``;
- ``content`` holds text; a list of content parts goes to ``content_parts`` (JSON) with ``content`` null;
- ``arguments`` holds the arguments as a JSON object wherever they are one (``datasets`` decodes it to the dict that
  chat templates ``| tojson``), and ``arguments_text`` holds the string when the call gave a string (the model's
  exact text, even malformed; a malformed one also stays a JSON string in ``arguments``). We read
  ``arguments_text`` first, so a string comes back byte for byte and a dict as a dict;
- ``json`` is arrow's canonical JSON extension type (storage: string), which ``datasets`` shows as ``Json()``;
- a tool call is one json value, not a struct with a json field: pyarrow cannot flatten a list column whose lists
  are all null in a chunk (no message of the chunk calls a tool) when its items are structs that hold an extension
  type, and ``datasets`` flattens them in ``save_to_disk`` and ``to_parquet``.

Reading (:func:`table_to_trajectories`, :func:`read_parquet`, :func:`from_hf_dataset`) also takes the layouts of
others: TRL datasets as they are (``messages`` only, or ``prompt`` + ``completion``; ``tools`` as structs or one
JSON string; tool-call ``arguments`` as structs or strings; tool messages without ids), and the files of orchard
0.1, whose nested columns were JSON text. Nulls inside arrow structs are dropped, because arrow fills every
key that another row has with null (a tool-call argument that was truly null cannot be told apart in such a dataset;
ours store arguments as JSON and keep it). Columns of no layout are ignored.

Floats go through JSON as their shortest round-trip repr and through parquet as float64, so they come back bit
for bit through our readers. Exactness holds for JSON-native data (tuples in ``metadata`` come back as lists).
``datasets`` itself decodes the json columns with pandas' ujson, whose floats may differ in the last digits, and
``load_dataset("json")`` on our JSONL files rounds every float of a batch to 10 decimals (see ``docs/data.md``): read
JSONL with :func:`read_jsonl`, or load parquet.

For other trainers, two one-way exports: :func:`to_token_dataset` (rendered samples as pre-tokenized rows with
``labels`` and the masks TRL reads, for SFT) and :func:`to_prompt_dataset` (the prompts of trajectories, for
``trl.GRPOTrainer`` and verl's RL datasets). Their layouts are in their docstrings.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import IO, Any, cast

from orchard._extras import requires_extra

with requires_extra("data"):
    import pyarrow as pa
    import pyarrow.parquet as pq

from orchard.data.render import RenderedSample
from orchard.data.schema import Message, ToolCall, Trajectory, trajectory_list


def _nested_schema(json_type: pa.DataType) -> pa.Schema:
    """The table layout, with ``json_type`` where the module docstring says json."""
    message = pa.struct(
        [
            ("role", pa.string()),
            ("content", pa.string()),
            ("content_parts", json_type),
            # Not list<struct<..., arguments: json>>, which datasets cannot save when no call is in a chunk.
            ("tool_calls", pa.list_(json_type)),
            ("tool_call_id", pa.string()),
            ("name", pa.string()),
            ("token_ids", pa.list_(pa.int64())),
            ("logprobs", pa.list_(pa.float64())),
        ]
    )
    return pa.schema(
        [
            ("messages", pa.list_(message)),
            ("tools", pa.list_(json_type)),
            ("task_id", pa.string()),
            ("group_id", pa.string()),
            ("reward", pa.float64()),
            ("termination_reason", pa.string()),
            ("num_steps", pa.int64()),
            ("reward_components", json_type),
            ("metadata", json_type),
        ]
    )


_SCHEMA = _nested_schema(pa.json_())
# pyarrow builds extension-typed children only by a cast from their storage, so rows are built with strings first.
_STORAGE_SCHEMA = _nested_schema(pa.string())


def _check_path(path: Any, name: str = "path") -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{name} must be a str or os.PathLike, got {type(path).__name__}")
    return os.fspath(path)


def _open(path: str, mode: str) -> IO[str]:
    if path.endswith(".gz"):
        return cast(IO[str], gzip.open(path, mode + "t", encoding="utf-8"))
    return open(path, mode, encoding="utf-8")


def write_jsonl(trajs: Iterable[Trajectory], path: str | os.PathLike[str], *, append: bool = False) -> int:
    """Write one trajectory per line (gzip when ``path`` ends with ``.gz``); returns the number written.

    ``append=True`` adds to an existing file (a rollout writer streaming results), else the file is replaced.
    """
    p = _check_path(path)
    items = trajectory_list(trajs)
    with _open(p, "a" if append else "w") as f:
        for t in items:
            f.write(t.to_json())
            f.write("\n")
    return len(items)


def iter_jsonl(path: str | os.PathLike[str]) -> Iterator[Trajectory]:
    """Yield trajectories from a JSONL file lazily; blank lines are skipped; a bad line raises ``ValueError``
    naming its line number."""
    p = _check_path(path)
    with _open(p, "r") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield Trajectory.from_dict(json.loads(line))
            except (json.JSONDecodeError, ValueError) as exc:
                raise ValueError(f"{p}:{lineno}: not a trajectory: {exc}") from exc


def read_jsonl(path: str | os.PathLike[str]) -> list[Trajectory]:
    """All trajectories of a JSONL file (see :func:`iter_jsonl`)."""
    return list(iter_jsonl(path))


def _json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"trajectory field {what!r} is not JSON-serialisable: {exc}") from exc


def _tool_call_row(call: ToolCall) -> str:
    parsed, _ = call.parse_arguments()
    function: dict[str, Any] = {"name": call.name, "arguments": parsed if parsed is not None else call.arguments}
    if isinstance(call.arguments, str):
        function["arguments_text"] = call.arguments
    row: dict[str, Any] = {"id": call.id} if call.id is not None else {}
    return _json({**row, "type": call.type, "function": function}, "arguments")


def _message_row(m: Message) -> dict[str, Any]:
    parts = isinstance(m.content, list)
    return {
        "role": m.role,
        "content": None if parts else m.content,
        "content_parts": _json(m.content, "content") if parts else None,
        "tool_calls": [_tool_call_row(c) for c in m.tool_calls] or None,
        "tool_call_id": m.tool_call_id,
        "name": m.name,
        "token_ids": m.token_ids,
        "logprobs": m.logprobs,
    }


def _row(t: Trajectory) -> dict[str, Any]:
    return {
        "messages": [_message_row(m) for m in t.messages],
        "tools": [_json(tool, "tools") for tool in t.tools],
        "task_id": t.task_id,
        "group_id": t.group_id,
        "reward": t.reward,
        "termination_reason": t.termination_reason,
        "num_steps": t.num_steps,
        "reward_components": _json(t.reward_components, "reward_components"),
        "metadata": _json(t.metadata, "metadata"),
    }


def _python(value: Any, type_: pa.DataType) -> Any:
    """An arrow value (as ``to_pylist`` gives it) as plain data: json decoded, struct nulls dropped."""
    if value is None:
        return None
    if isinstance(type_, pa.JsonType):
        return json.loads(value)
    if pa.types.is_struct(type_):
        fields = {type_.field(i).name: type_.field(i).type for i in range(type_.num_fields)}
        out = {k: _python(v, fields[k]) for k, v in value.items()}
        return {k: v for k, v in out.items() if v is not None}
    if pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_fixed_size_list(type_):
        return [_python(v, type_.value_type) for v in value]
    return value


def _decoded(value: Any, name: str, where: str) -> Any:
    """A field of orchard 0.1's layout (JSON text) or of TRL's (tools as one JSON string) decoded; others as given."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: column {name!r} holds a string that is not JSON: {exc}") from exc


def _message_dict(m: Any) -> Any:
    if not isinstance(m, Mapping):
        return m  # Message.from_dict names the problem
    m = dict(m)
    if "content_parts" in m:
        m["content"] = m.pop("content_parts")
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        m["tool_calls"] = [_tool_call_dict(c) for c in calls]
    return m


def _tool_call_dict(c: Any) -> Any:
    fn = c.get("function") if isinstance(c, Mapping) else None
    if not isinstance(fn, Mapping) or "arguments_text" not in fn:
        return c
    fn = dict(fn)
    fn["arguments"] = fn.pop("arguments_text")
    return {**c, "function": fn}


def _from_row(row: Mapping[str, Any], where: str) -> Trajectory:
    if "messages" in row:
        messages = _decoded(row["messages"], "messages", where)
    elif "prompt" in row and "completion" in row:  # TRL's conversational prompt-completion type
        prompt, completion = row["prompt"], row["completion"]
        if not isinstance(prompt, list) or not isinstance(completion, list):
            raise ValueError(
                f"{where}: 'prompt' and 'completion' must be lists of messages (TRL's conversational format), "
                f"got {type(prompt).__name__} and {type(completion).__name__}"
            )
        messages = prompt + completion
    else:
        raise ValueError(f"{where}: no 'messages' column (nor 'prompt' and 'completion')")
    if not isinstance(messages, list):
        raise ValueError(f"{where}: 'messages' must be a list of messages, got {type(messages).__name__}")
    data: dict[str, Any] = {"messages": [_message_dict(m) for m in messages]}
    for name in ("tools", "reward_components", "metadata"):
        if row.get(name) is not None:
            data[name] = _decoded(row[name], name, where)
    for name in ("task_id", "group_id", "reward", "termination_reason"):
        if row.get(name) is not None:
            data[name] = row[name]
    try:
        return Trajectory.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def trajectories_to_table(trajs: Iterable[Trajectory]) -> pa.Table:
    """The arrow table (layout in the module docstring) of the trajectories."""
    rows = [_row(t) for t in trajectory_list(trajs)]
    # One record batch, also when empty: pyarrow cannot combine zero chunks of an extension type, which
    # ``datasets`` does to fingerprint a table.
    return pa.Table.from_batches([pa.RecordBatch.from_pylist(rows, schema=_STORAGE_SCHEMA).cast(_SCHEMA)])


def table_to_trajectories(table: pa.Table) -> list[Trajectory]:
    """Trajectories of an arrow table in our layout (inverse of :func:`trajectories_to_table`), orchard 0.1's, or
    TRL's (see the module docstring)."""
    if not isinstance(table, pa.Table):
        raise ValueError(f"table must be a pyarrow.Table, got {type(table).__name__}")
    types = {f.name: f.type for f in table.schema}
    return [
        _from_row({k: _python(v, types[k]) for k, v in row.items()}, f"row {i}")
        for i, row in enumerate(table.to_pylist())
    ]


def write_parquet(trajs: Iterable[Trajectory], path: str | os.PathLike[str]) -> int:
    """Write trajectories to a parquet file (zstd); returns the number written."""
    p = _check_path(path)
    table = trajectories_to_table(trajs)
    pq.write_table(table, p, compression="zstd")
    return table.num_rows


def read_parquet(path: str | os.PathLike[str]) -> list[Trajectory]:
    """Read a file written by :func:`write_parquet`."""
    return table_to_trajectories(pq.read_table(_check_path(path)))


def to_hf_dataset(trajs: Iterable[Trajectory]) -> Any:
    """A ``datasets.Dataset`` with the table layout of the module docstring (one row per trajectory), which
    ``trl.SFTTrainer`` takes as it is."""
    with requires_extra("data"):
        import datasets

    return datasets.Dataset(trajectories_to_table(trajs))


def from_hf_dataset(dataset: Any) -> list[Trajectory]:
    """Trajectories from a ``datasets.Dataset``: ours (:func:`to_hf_dataset`, ``load_dataset("parquet")`` of
    :func:`write_parquet` files), or a TRL conversational dataset as it is (see the module docstring).

    The rows are read from the arrow table under the dataset (filters and selections applied), not through
    ``datasets``' decoding, so floats inside json columns come back exactly."""
    with requires_extra("data"):
        import datasets

    if not isinstance(dataset, datasets.Dataset):
        raise ValueError(f"dataset must be a datasets.Dataset, got {type(dataset).__name__}")
    return table_to_trajectories(dataset.with_format("arrow")[:])


_TOKEN_SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int64())),
        ("attention_mask", pa.list_(pa.int8())),
        ("labels", pa.list_(pa.int64())),
        ("completion_mask", pa.list_(pa.int8())),
        ("assistant_masks", pa.list_(pa.int8())),
    ]
)

IGNORE_INDEX = -100
"""The label of a token that is not trained on (what ``torch.nn.CrossEntropyLoss`` and HF models ignore)."""


def to_token_dataset(samples: Iterable[RenderedSample]) -> Any:
    """Rendered samples as a pre-tokenized ``datasets.Dataset``, one row per sample, which ``trl.SFTTrainer``
    takes as it is (a dataset with ``input_ids`` is not tokenized again) and which any HF causal-LM trainer reads.

    Columns, each a list of length ``T`` (the sample's length):

    - ``input_ids`` (int64): ``sample.input_ids``;
    - ``attention_mask`` (int8): all 1 (samples are not padded; a collator pads);
    - ``labels`` (int64): ``input_ids`` where ``action_mask`` is True, :data:`IGNORE_INDEX` (-100) elsewhere; HF
      models shift labels themselves, so the loss trains exactly the tokens the policy generated;
    - ``completion_mask`` and ``assistant_masks`` (int8): ``action_mask`` as 0/1, the masks TRL folds into the
      labels (``assistant_masks`` always, ``completion_mask`` with ``completion_only_loss``) where no ``labels``
      column is given, so every TRL path trains on the same tokens.

    An empty ``samples`` gives an empty dataset with these columns. Samples with images are refused (their
    ``pixel_values`` would be lost); so is anything that is not a :class:`RenderedSample` (e.g. the None that
    ``render_trajectory(..., on_mismatch="drop")`` returns: filter those out first).
    """
    with requires_extra("data"):
        import datasets

    if isinstance(samples, RenderedSample) or not isinstance(samples, Iterable):
        raise ValueError(f"samples must be an iterable of RenderedSample, got {type(samples).__name__}")
    rows = []
    for i, sample in enumerate(samples):
        if not isinstance(sample, RenderedSample):
            raise ValueError(f"samples[{i}] must be a RenderedSample, got {type(sample).__name__}")
        if sample.pixel_values is not None:
            raise ValueError(f"samples[{i}] has images, which a token dataset cannot carry")
        if sample.input_ids.dim() != 1 or sample.action_mask.shape != sample.input_ids.shape:
            raise ValueError(
                f"samples[{i}]: input_ids and action_mask must both have shape [T], got "
                f"{tuple(sample.input_ids.shape)} and {tuple(sample.action_mask.shape)}"
            )
        ids = sample.input_ids.tolist()
        action = sample.action_mask.bool().tolist()
        mask = [int(a) for a in action]
        rows.append({
            "input_ids": ids,
            "attention_mask": [1] * len(ids),
            "labels": [t if a else IGNORE_INDEX for t, a in zip(ids, action, strict=True)],
            "completion_mask": mask,
            "assistant_masks": mask,
        })
    return datasets.Dataset(pa.Table.from_pylist(rows, schema=_TOKEN_SCHEMA))


def _prompt_schema(json_type: pa.DataType) -> pa.Schema:
    """The layout of :func:`to_prompt_dataset`, with ``json_type`` where its docstring says json."""
    return pa.schema(
        [
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("task_id", pa.string()),
            ("data_source", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", pa.struct([("index", pa.int64()), ("task_id", pa.string())])),
            ("tools", pa.list_(json_type)),
            ("metadata", json_type),
        ]
    )


def _prompt_messages(t: Trajectory, where: str) -> list[dict[str, str]]:
    prompt = []
    for j, m in enumerate(t.messages):
        if m.role == "assistant":
            break
        if not isinstance(m.content, str):
            raise ValueError(f"{where}.messages[{j}]: content parts (images) cannot go in a prompt dataset")
        prompt.append({"role": m.role, "content": m.content})
    if not prompt:
        raise ValueError(f"{where} has no message before its first assistant turn, so no prompt")
    return prompt


def to_prompt_dataset(trajs: Iterable[Trajectory], *, data_source: str = "orchard") -> Any:
    """The prompts of trajectories as a ``datasets.Dataset``, one row per trajectory, in the layout of RL prompt
    datasets: ``trl.GRPOTrainer`` takes it as it is, and it has the columns of verl's RL parquet files.

    Columns:

    - ``prompt``: the messages before the first assistant turn (system, user), each ``{"role", "content"}``;
      conversational, so the trainer applies the policy's chat template;
    - ``task_id`` (string, null allowed): which task a reward function should score;
    - ``data_source`` (string): ``data_source`` for every row (verl picks a reward function by it);
    - ``reward_model``: ``{"style": "rule", "ground_truth": task_id}`` (verl's reward managers read
      ``ground_truth``; our verifiers score by task id);
    - ``extra_info``: ``{"index": row, "task_id": task_id}``;
    - ``tools`` (list of json): the trajectory's tool schemas;
    - ``metadata`` (json): ``Trajectory.metadata``.

    TRL passes every column but ``prompt`` to the reward functions as keyword lists. An empty ``trajs`` gives an
    empty dataset with these columns. A trajectory with no message before its first assistant turn, or with
    content parts (images) there, is a ``ValueError`` naming it.
    """
    with requires_extra("data"):
        import datasets

    if not isinstance(data_source, str) or not data_source:
        raise ValueError(f"data_source must be a non-empty string, got {data_source!r}")
    rows = []
    for i, t in enumerate(trajectory_list(trajs)):
        rows.append({
            "prompt": _prompt_messages(t, f"trajs[{i}]"),
            "task_id": t.task_id,
            "data_source": data_source,
            "reward_model": {"style": "rule", "ground_truth": t.task_id},
            "extra_info": {"index": i, "task_id": t.task_id},
            "tools": [_json(tool, "tools") for tool in t.tools],
            "metadata": _json(t.metadata, "metadata"),
        })
    batch = pa.RecordBatch.from_pylist(rows, schema=_prompt_schema(pa.string())).cast(_prompt_schema(pa.json_()))
    return datasets.Dataset(pa.Table.from_batches([batch]))
