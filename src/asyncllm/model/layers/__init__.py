"""Layers the model definitions share: paged attention and its per-step metadata, the decode K/V mirror, rotary
embeddings."""
