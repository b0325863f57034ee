"""vLLM example scripts ported with only their imports and model name changed (run by `test_vllm_compat.py`)."""
