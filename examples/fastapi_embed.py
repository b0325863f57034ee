"""Embed `AsyncLLM` in your own FastAPI app: start it in the lifespan, stream from your own endpoint.

    python examples/fastapi_embed.py --port 8001
    curl -N "http://127.0.0.1:8001/ask?question=Why+is+the+sky+blue%3F&max_tokens=64"

The engine starts before the app accepts requests (`AsyncLLM.create`: in a worker thread, so the event loop
stays free) and stops when the app stops. A client that disconnects mid-answer closes the stream, which aborts
its request.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse

from asyncllm import AsyncLLM, EngineArgs, InvalidRequestError, RequestOutputKind, SamplingParams


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # create() starts the engine in a worker thread (the loop stays free); `async with` shuts it down at exit
    async with AsyncLLM.create(EngineArgs(model="smollm2-135m-instruct")) as llm:
        app.state.llm = llm
        yield


app = FastAPI(lifespan=lifespan)


@app.get("/ask")
async def ask(question: str, max_tokens: int = 64) -> StreamingResponse:
    """Stream the model's answer to `question` as plain text."""
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, output_kind=RequestOutputKind.DELTA)
        stream = app.state.llm.generate([{"role": "user", "content": question}], params)
    except InvalidRequestError as error:  # e.g. max_tokens=0: a clear 400, the engine keeps serving
        raise HTTPException(status_code=400, detail=str(error)) from error

    async def text() -> AsyncIterator[str]:
        async with stream:  # closing the stream (also on disconnect) aborts the request
            async for output in stream:
                yield output.outputs[0].text

    return StreamingResponse(text(), media_type="text/plain")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port)
