"""Run the app under uvicorn, with graceful shutdown.

On SIGTERM or SIGINT uvicorn stops accepting connections and lets in-flight responses (streams included) finish
for up to `grace_period` seconds. Then the requests still in flight are aborted: each stream ends normally with
`finish_reason="abort"` and `data: [DONE]`, each non-streaming response with its partial text. Anything still
running `ABORT_MARGIN_S` later is cancelled by uvicorn (closing its `GenerateOutputStream`, which aborts the
request too). Then the app's lifespan shuts the engine down (its process is joined, so nothing is left behind).
A second signal skips the wait; the engine is still shut down on the way out.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asyncllm.entrypoints.openai.app import ServerConfig, build_app

logger = logging.getLogger(__name__)

DEFAULT_GRACE_PERIOD_S = 10.0
ABORT_MARGIN_S = 5  # seconds between aborting the requests left and uvicorn cancelling their tasks


async def serve(
    config: ServerConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    grace_period: float = DEFAULT_GRACE_PERIOD_S,
    log_level: str = "info",
) -> None:
    """Serve until SIGTERM/SIGINT; returns after the engine has stopped.

    Args:
        host: the interface to bind (127.0.0.1 by default: loopback only).
        port: TCP port; 0 picks a free one.
        grace_period: seconds in-flight requests may still run after a shutdown signal.
    Raises:
        SystemExit: uvicorn could not start (e.g. the port is in use, or the engine failed to start).
    """
    import uvicorn

    app = build_app(config)
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=round(grace_period) + ABORT_MARGIN_S,  # uvicorn takes whole seconds
        root_path=config.root_path,
    )
    server = uvicorn.Server(uv_config)
    watcher = asyncio.create_task(_abort_after_grace(server, app, grace_period), name="asyncllm-grace-watcher")
    try:
        await server.serve()
    finally:
        watcher.cancel()
        llm = getattr(app.state, "llm", None)
        if llm is not None and not server.started:
            logger.warning("the server did not start; stopping the engine")
        if llm is not None:
            await llm.shutdown()  # idempotent: normally the lifespan already did it
    if not server.started:
        raise SystemExit(1)


async def _abort_after_grace(server: Any, app: Any, grace_period: float) -> None:
    """Once uvicorn is asked to exit, wait `grace_period` seconds, then abort every request still in flight."""
    while not server.should_exit:  # noqa: ASYNC110 (uvicorn sets a plain attribute, no event to wait on)
        await asyncio.sleep(0.1)
    await asyncio.sleep(grace_period)
    ctx = getattr(app.state, "ctx", None)
    if ctx is not None and ctx.in_flight:
        logger.warning("grace period over: aborting %d request(s) still in flight", len(ctx.in_flight))
        await app.state.llm.abort(list(ctx.in_flight))


def run_server(config: ServerConfig, host: str, port: int, grace_period: float, log_level: str = "info") -> None:
    """`asyncio.run(serve(...))`: the blocking entry point of `asyncllm serve`."""
    asyncio.run(serve(config, host, port, grace_period, log_level))
