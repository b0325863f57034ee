"""Where the kernel chooser keeps its measurements: one JSON file per host fingerprint beside the built kernels."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
import platform
import re
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

from asyncllm.utils.cpu_info import cpu_info

logger = logging.getLogger(__name__)
CACHE_VERSION = 5  # bump when the measuring or the choosing changes (2: passes over weight copies; 3: fp32 order;
# 4: one packed copy per weight; 5: but the 1-row class's own where it is 15% faster)


class ChoiceCache:
    """The choices measured on one host, in `<directory>/linear-kernels-<digest of key>.json`.

    The file holds the key (for a person reading it) and one JSON entry per kind and shape. Reads that fail
    (missing, unreadable, another key or version) find nothing; writes merge with what another process wrote
    meanwhile and replace the file atomically; a write that fails is logged and the choice lives in this process
    only.
    """

    def __init__(self, directory: pathlib.Path, key: Mapping[str, str]) -> None:
        self.key = dict(key)
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = directory / f"linear-kernels-{digest}.json"

    def get(self, name: str) -> dict[str, Any] | None:
        """The entry stored under `name` (e.g. "int8 576x960"), or None."""
        entry = self._read().get(name)
        return entry if isinstance(entry, dict) else None

    def put(self, name: str, entry: dict[str, Any]) -> None:
        """Store `entry` under `name`, merged with the file's current contents."""
        entries = self._read()
        entries[name] = entry
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
                json.dump({"version": CACHE_VERSION, "key": self.key, "choices": entries}, f, indent=1)
            os.replace(f.name, self.path)
        except OSError as exc:
            logger.warning("could not cache linear kernel choices in %s (%s); measured at each start", self.path, exc)

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or data.get("key") != self.key:
            return {}
        choices = data.get("choices")
        return choices if isinstance(choices, dict) else {}


def kernel_cache_dir() -> pathlib.Path:
    """`$XDG_CACHE_HOME/asyncllm/kernels` (default `~/.cache/asyncllm/kernels`), where the row kernels build too."""
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "asyncllm" / "kernels"


@functools.cache
def host_fingerprint() -> dict[str, str]:
    """What makes a kernel's speed differ between hosts: CPU model and ISA flags (`utils/cpu_info.py`), torch,
    oneDNN and MKL versions (from `torch.__config__.show()`), and torch's thread count when first called."""
    info = cpu_info()
    config = torch.__config__.show()
    onednn = re.search(r"MKL-DNN (v[\d.]+)", config)
    mkl = re.search(r"Math Kernel Library Version ([\w.-]+)", config)
    return {
        "cpu": info.model,
        "machine": platform.machine(),
        "cpu_flags": hashlib.sha256(" ".join(sorted(info.flags)).encode()).hexdigest()[:16],
        "torch": torch.__version__,
        "onednn": onednn[1] if onednn else "none",
        "mkl": mkl[1] if mkl else "none",
        "threads": str(torch.get_num_threads()),
    }
