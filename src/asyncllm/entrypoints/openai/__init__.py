"""The OpenAI-compatible HTTP server (FastAPI + uvicorn; `pip install asyncllm[server]`).

`protocol.py` (request models) and `responses.py` (response models) -> `serving_completion.py` /
`serving_chat.py` (requests to `SamplingParams`, `RequestOutput`s to JSON or SSE; shared parts in
`serving_base.py`, logprobs shapes in `logprobs.py`) -> `app.py` (routes, lifespan, auth) -> `server.py` (uvicorn
with graceful shutdown). `errors.py` turns every failure into an OpenAI error body.
"""
