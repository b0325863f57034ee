"""Tensor-parallel process group state (`parallel_state`)."""
