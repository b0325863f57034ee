"""Ways in from outside Python code: the `asyncllm` command (`cli.py`) and the OpenAI-compatible server
(`openai/`). Everything here uses the public `AsyncLLM` API only."""
