"""`draftgraph serve MODEL`: the engine flags plus the HTTP ones.

Top-level imports stay light (no FastAPI/uvicorn): `draftgraph.cli` imports this module to
build its parser on machines without the server extras.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

logger = logging.getLogger(__name__)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("DRAFTGRAPH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes "
                        "(default: $DRAFTGRAPH_API_KEY; unset: no key)")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="name(s) clients use in 'model' (repeatable; default: the model arg)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")


def build_server(engine_config, server_config, loaded=None):
    """(app, async_engine) for an engine config; loads the model."""
    from draftgraph.engine.engine import LLMEngine
    from draftgraph.server.app import build_app
    from draftgraph.server.async_engine import AsyncEngine

    engine = LLMEngine(engine_config, loaded=loaded)
    async_engine = AsyncEngine(engine)
    return build_app(async_engine, server_config), async_engine


def cmd_serve(args: argparse.Namespace) -> int:
    from draftgraph.cli import engine_config_from_args
    from draftgraph.server.config import ServerConfig

    try:
        import uvicorn
    except ImportError as e:
        print(f"error: {e}. Install with: pip install 'draftgraph[server]'", file=sys.stderr)
        return 2
    try:
        engine_config = engine_config_from_args(args)
        server_config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                                     served_model_names=args.served_model_name or [args.model])
        app, _ = build_server(engine_config, server_config)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.getLogger("draftgraph").setLevel(logging.INFO)
    print(f"draftgraph: serving {server_config.served_model_names[0]} on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0
