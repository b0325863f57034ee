"""Kernels: every linear product (`linear.py`, on the kernel `choice.py` measured for the host: `int8.py`, `fp32.py`)
and the fused row operations (`row_kernels.py`, C++ in `csrc/`). Kernels import nothing from the model definitions,
layers or loading."""
