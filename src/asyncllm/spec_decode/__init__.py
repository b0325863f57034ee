"""Speculative decoding: the n-gram proposer (engine core), rejection sampling (worker), metrics."""
