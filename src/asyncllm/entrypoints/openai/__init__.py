"""The OpenAI-compatible HTTP server (FastAPI + uvicorn; `pip install asyncllm[server]`).

`protocol.py` (request and response models) -> `serving_completion.py` / `serving_chat.py` (requests to
`SamplingParams`, `RequestOutput`s to JSON or SSE) -> `app.py` (routes, lifespan, auth) -> `server.py` (uvicorn
with graceful shutdown). `errors.py` turns every failure into an OpenAI error body.
"""
