"""Loading: model names to files (`resolve.py`), GGUF and HF checkpoints to a model definition with its weights
(`loader.py`, `gguf_metadata.py`), tokenizers and chat templates (`tokenizer.py`)."""
