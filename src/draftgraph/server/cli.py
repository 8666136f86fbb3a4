"""`draftgraph serve [MODEL]`: the engine flags (draftgraph.flags) plus the HTTP ones.

Everything that can fail without the model is checked first: the flags, then the port is
bound, and only then does the model load (a busy port is an immediate error, not one after
the weights have loaded).

Top-level imports stay light (no FastAPI/uvicorn): `draftgraph.cli` imports this module to
build its parser on machines without the server extras.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys

from draftgraph.flags import (
    apply_process_flags,
    engine_config_from_args,
    resolve_model,
    usage_error,
)

logger = logging.getLogger(__name__)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from draftgraph.server.config import ServerConfig

    h = p.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="interface to bind")
    h.add_argument("--port", type=int, default=8000, help="TCP port to bind")
    h.add_argument("--api-key", default=os.environ.get("DRAFTGRAPH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes "
                        "(default: $DRAFTGRAPH_API_KEY; unset: no key)")
    h.add_argument("--api-key-file", default=None,
                   help="read the key from this file's first line (it then shows in no `ps` "
                        "listing); not with --api-key")
    h.add_argument("--served-model-name", action="append", default=None,
                   help="name(s) clients use in 'model' (repeatable; default: the model arg)")
    h.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    h.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes,
                   help="larger request bodies are answered 413")
    h.add_argument("--body-read-timeout", type=float, default=ServerConfig.body_read_timeout_s,
                   help="seconds to receive a request body before a 408")
    h.add_argument("--engine-process", choices=["auto", "on", "off"], default="auto",
                   help="run the engine loop in its own process, so streaming responses never "
                        "hold the GIL the engine's steps need (auto: on a GPU; off: a thread "
                        "of the server process)")
    h.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP front-end processes sharing the port, all feeding the one engine "
                        "process (vLLM's flag of the name): at high concurrency on a small "
                        "model one process's event loop (HTTP, JSON, SSE) cannot keep up with "
                        "the engine's tokens. Needs the engine in its own process. Each "
                        "process's /metrics counts every process's requests (the others' "
                        "up to ~2 s late)")
    h.add_argument("--shutdown-timeout", type=float, default=ServerConfig.shutdown_timeout_s,
                   help="seconds running requests may take to finish after SIGTERM before "
                        "their streams end with an error event")


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket bound to host:port; ValueError saying what to change when
    the port is taken or the address is not this machine's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # NOTE: proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose
    # proto says TCP. Without it every response after a connection's first waited ~40 ms
    # (Nagle's algorithm against the client's delayed ACK): keep-alive clients, SSE chunks.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is already in use (another server?); "
                             "pick a free one with --port") from None
        raise ValueError(f"cannot bind {host}:{port} ({e.strerror}); check --host and "
                         "--port") from None
    sock.set_inheritable(True)
    return sock


def build_server(engine_config, server_config, loaded=None, engine_process: bool = False,
                 api_server_count: int = 1):
    """(app, async_engine) for an engine config; loads the model (in a process of its own
    with engine_process: server/engine_process.py; the pipes of the other API servers are
    then the client's `links`)."""
    from draftgraph.server.app import build_app

    if engine_process:
        from draftgraph.server.engine_process import EngineClient, ProcessAsyncEngine

        if loaded is not None:
            raise ValueError("an engine process loads its model itself: pass no loaded model")
        async_engine = ProcessAsyncEngine(EngineClient.start(
            engine_config, num_api_servers=api_server_count))
    else:
        from draftgraph.engine.engine import LLMEngine
        from draftgraph.server.async_engine import AsyncEngine

        async_engine = AsyncEngine(LLMEngine(engine_config, loaded=loaded))
    return build_app(async_engine, server_config), async_engine


def start_api_servers(client, sock: socket.socket, server_config, log_level: str) -> None:
    """Spawn an API-server process for each of `client.links` (the primary's engine client),
    serving on `sock` beside this one; the client stops them before the engine."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    count = len(client.links) + 1
    for i, (commands, results) in enumerate(client.links, 1):
        p = ctx.Process(target=run_api_server, name=f"draftgraph-api-{i}", daemon=False,
                        args=(sock, commands, results, server_config, count, log_level))
        p.start()
        client.api_servers.append(p)
        commands.close()  # theirs now: the engine sees EOF when that process goes
        results.close()
    client.links = []
    client.drain_s = server_config.shutdown_timeout_s + 5


def run_api_server(sock, commands, results, server_config, count: int, log_level: str) -> None:
    """A secondary API server's process: the app over the engine the primary started."""
    import uvicorn

    from draftgraph.server.app import build_app
    from draftgraph.server.engine_process import EngineClient, ProcessAsyncEngine

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("draftgraph").setLevel(logging.INFO)
    ae = ProcessAsyncEngine(EngineClient.attach(commands, results, count))
    server = uvicorn.Server(uvicorn.Config(
        build_app(ae, server_config), log_level=log_level,
        timeout_graceful_shutdown=server_config.shutdown_timeout_s + 5))
    ae.on_engine_gone = lambda: setattr(server, "should_exit", True)  # the primary died
    server.run(sockets=[sock])


def wants_engine_process(choice: str, device: str) -> bool:
    """--engine-process: auto is on for a GPU engine (measured there), off on the CPU, where
    the engine's threads already take every core."""
    return choice == "on" or (choice == "auto" and device.startswith("cuda"))


def cmd_serve(args: argparse.Namespace) -> int:
    from draftgraph.engine.errors import EngineError
    from draftgraph.server.config import ServerConfig

    try:
        import uvicorn
    except ImportError as e:
        print(f"error: {e}. Install with: pip install 'draftgraph[server]'", file=sys.stderr)
        return 2
    try:  # everything that needs no model, before the model loads
        engine_config = engine_config_from_args(args)
        server_config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                                     api_key_file=args.api_key_file,
                                     served_model_names=args.served_model_name
                                     or [resolve_model(args)],
                                     max_body_bytes=args.max_body_bytes,
                                     body_read_timeout_s=args.body_read_timeout,
                                     shutdown_timeout_s=args.shutdown_timeout)
        engine_process = wants_engine_process(args.engine_process, engine_config.device)
        if args.api_server_count < 1:
            raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
        if args.api_server_count > 1 and not engine_process:
            raise ValueError("--api-server-count above 1 needs the engine in its own process: "
                             "add --engine-process on (the default only on a GPU)")
        sock = bind_socket(args.host, args.port)
    except ValueError as e:
        usage_error(args, str(e))
    apply_process_flags(args)
    try:
        app, ae = build_server(engine_config, server_config, engine_process=engine_process,
                               api_server_count=args.api_server_count)
    except (ValueError, FileNotFoundError, ImportError, EngineError) as e:
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.getLogger("draftgraph").setLevel(logging.INFO)
    if args.api_server_count > 1:
        start_api_servers(ae.engine, sock, server_config, args.log_level)
    port = sock.getsockname()[1]
    print(f"draftgraph: serving {server_config.served_model_names[0]} on "
          f"http://{args.host}:{port}/v1", file=sys.stderr, flush=True)
    # NOTE: the app's lifespan drains for --shutdown-timeout; uvicorn must not cut it short
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=port, log_level=args.log_level,
        timeout_graceful_shutdown=server_config.shutdown_timeout_s + 5))
    server.run(sockets=[sock])
    return 0
