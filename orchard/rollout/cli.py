"""`orchard serve-model` (an OpenAI-compatible server over the HF engine) and `orchard serve-proxy` (the recording
proxy in front of any OpenAI-compatible server)."""

from __future__ import annotations

import argparse
import asyncio
import socket
from pathlib import Path
from typing import Any

from orchard._extras import requires_extra
from orchard._uvicorn import quiet_shutdown_cancellations

READY_PREFIX = "ORCHARD_MODEL_URL="


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``serve-model`` and ``serve-proxy`` to the top-level ``orchard`` parser."""
    serve = subparsers.add_parser(
        "serve-model",
        help="serve a HF model (or 'tiny') behind an OpenAI-compatible API with token ids and log-probs",
        description="Serves /v1/chat/completions (tools, tool_calls, logprobs, token ids as vLLM), "
        f"/v1/completions, /v1/models, /health. Prints {READY_PREFIX}http://host:port once it listens.",
    )
    serve.add_argument("--model", required=True, help="a local HF model directory, or 'tiny' (a random tiny Qwen3)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind")
    serve.add_argument("--port", type=int, default=8001,
                       help="port (0: any free port); not 8000, the sandbox client's default URL")
    serve.add_argument("--model-name", default=None, help="the id /v1/models lists (default: the --model value)")
    serve.add_argument("--device", default="cpu", help="torch device, e.g. cuda:0")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                       help="weights' dtype")
    serve.add_argument("--max-batch-size", type=int, default=32, help="rows per forward batch")
    serve.add_argument("--max-tokens", type=int, default=512, help="default max_tokens of chat requests")
    serve.add_argument("--seed", type=int, default=0, help="seed of requests that give none")
    serve.add_argument("--compile-decode", action="store_true",
                       help="run the decode step through torch.compile (compiled at start-up: tens of seconds; "
                       "then fewer kernels per token; see HFEngine's compile_decode)")
    serve.add_argument(
        "--allow-weight-updates",
        action="store_true",
        help="serve POST /update_weights {path} (reads checkpoints from this machine)",
    )
    serve.add_argument("--log-level", default="info", help="uvicorn's log level (info: a line per request)")
    serve.set_defaults(func=_serve_model)

    proxy = subparsers.add_parser(
        "serve-proxy",
        help="record every call to an OpenAI-compatible server, by session, for training",
        description="Forwards /v1/... (and /sessions/{id}/v1/...) to --upstream with token ids and log-probs on; "
        "GET /sessions/{id}/calls returns what a session recorded. "
        f"Prints {READY_PREFIX}http://host:port once it listens.",
    )
    proxy.add_argument("--upstream", required=True,
                       help="base URL of the server, e.g. http://127.0.0.1:8001 (a trailing /v1 is accepted)")
    proxy.add_argument("--tokenizer", default=None,
                       help="the upstream model's tokenizer: a local HF directory or 'tiny'; the proxy then asks for "
                       "token-id labels, which any vLLM returns (None: the upstream must return token_ids, as "
                       "orchard serve-model and vLLM >= 0.10.2 do)")
    proxy.add_argument("--host", default="127.0.0.1", help="interface to bind")
    proxy.add_argument("--port", type=int, default=8002, help="port (0: any free port)")
    proxy.add_argument("--record-dir", default=None, metavar="PATH",
                       help="keep every session in PATH/<session>.jsonl (made if missing) and load the sessions "
                       "already there, so they survive a restart (None: memory only)")
    proxy.add_argument("--log-level", default="info", help="uvicorn's log level (info: a line per request)")
    proxy.set_defaults(func=_serve_proxy)


def load_tokenizer(name: str) -> Any:
    """``tiny`` (the offline chat tokenizer of ``orchard.models.tiny_chat_model``), a local HF directory or a named
    pretrained checkpoint (its template replaced when it cannot render tools)."""
    if name == "tiny":
        from orchard.data.tokenizer import build_chat_tokenizer

        return build_chat_tokenizer()
    # the command line resolves names through the models layer (a CLI is glue above every layer)
    from orchard.models.pretrained import load_chat_tokenizer

    return load_chat_tokenizer(_checkpoint(name, "--tokenizer"))


def _checkpoint(name: str, flag: str) -> str:
    from orchard.models.pretrained import PRETRAINED

    if name not in PRETRAINED and not Path(name).is_dir():
        # Checked here: transformers would take the path for a hub repo id and fail with a page of traceback.
        raise ValueError(f"{flag} {name!r} is not a directory; give a local HF model directory, a named checkpoint "
                         f"({', '.join(sorted(PRETRAINED))}) or 'tiny'")
    return name


def load_model_and_tokenizer(name: str, *, device: str = "cpu", dtype: str = "float32") -> tuple[Any, Any]:
    """``tiny`` (``orchard.models.tiny_chat_model``), a local HF model directory or a named pretrained checkpoint
    (nothing is downloaded)."""
    import torch

    if name == "tiny":
        from orchard.models import tiny_chat_model

        model, tokenizer = tiny_chat_model()
        return model.to(device=device, dtype=getattr(torch, dtype)), tokenizer
    with requires_extra("rollout"):
        from transformers import AutoModelForCausalLM

    from orchard.models.pretrained import load_chat_tokenizer, resolve_checkpoint

    directory = resolve_checkpoint(_checkpoint(name, "--model"))
    tokenizer = load_chat_tokenizer(name)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype), local_files_only=True)
    return model.to(device).eval(), tokenizer


def _bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


def run_app(app: Any, host: str, port: int, log_level: str = "warning") -> None:
    """Serve ``app`` in the foreground; prints ``ORCHARD_MODEL_URL=...`` once it listens."""
    with requires_extra("rollout"):
        import uvicorn

    sock = _bind(host, port)
    config = uvicorn.Config(app, log_level=log_level, lifespan="off")
    quiet_shutdown_cancellations()
    server = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            bound = sock.getsockname()[1]
            print(f"{READY_PREFIX}http://{f'[{host}]' if ':' in host else host}:{bound}", flush=True)
        await task

    asyncio.run(main())


def _serve_model(args: argparse.Namespace) -> int:
    from orchard.rollout.hf_engine import HFEngine
    from orchard.rollout.server import build_app

    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device, dtype=args.dtype)
    engine = HFEngine(
        model, pad_token_id=tokenizer.pad_token_id, max_batch_size=args.max_batch_size, seed=args.seed,
        compile_decode=args.compile_decode,
    )
    app = build_app(
        engine,
        tokenizer,
        model_name=args.model_name or args.model,
        default_max_tokens=args.max_tokens,
        allow_weight_updates=args.allow_weight_updates,
    )
    run_app(app, args.host, args.port, args.log_level)
    return 0


def _serve_proxy(args: argparse.Namespace) -> int:
    from orchard.rollout.proxy import RecordingProxy

    tokenizer = None if args.tokenizer is None else load_tokenizer(args.tokenizer)
    proxy = RecordingProxy(args.upstream, tokenizer, record_dir=args.record_dir)
    run_app(proxy.app, args.host, args.port, args.log_level)
    return 0
