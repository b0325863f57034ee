"""The package's public surface: exports, `dir()`, `__version__`, `EngineArgs` with a `pathlib.Path`."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

import asyncllm
from asyncllm import ConfigError, EngineArgs, ModelNotFoundError


def test_model_not_found_error_is_exported_and_a_value_error() -> None:
    assert asyncllm.ModelNotFoundError is ModelNotFoundError
    assert issubclass(ModelNotFoundError, ValueError)
    assert "ModelNotFoundError" in asyncllm.__all__


def test_dir_lists_the_lazily_imported_classes() -> None:
    names = dir(asyncllm)
    for name in ("AsyncLLM", "GenerateOutputStream", "EngineArgs", "SamplingParams", "__version__"):
        assert name in names
    assert set(asyncllm.__all__) <= set(names)


def test_every_name_in_all_resolves() -> None:
    for name in asyncllm.__all__:
        assert getattr(asyncllm, name) is not None


def test_unknown_attribute_raises_attribute_error_naming_it() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        asyncllm.NoSuchThing  # noqa: B018


def test_version_matches_pyproject() -> None:
    pyproject = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"
    match = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.MULTILINE)
    assert match is not None
    assert asyncllm.__version__ == match[1]


def test_importing_asyncllm_stays_light() -> None:
    code = "import sys, asyncllm; dir(asyncllm); asyncllm.__version__; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_engine_args_accepts_a_pathlib_path(model_path: str) -> None:
    config = EngineArgs(model=pathlib.Path(model_path), load_format="dummy").create_engine_config()
    assert config.model.model == model_path
    assert config.model.model_path == str(pathlib.Path(model_path).resolve())


def test_engine_args_missing_gguf_names_the_file(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "absent.gguf"
    with pytest.raises(ModelNotFoundError, match=f"model file '{missing}' does not exist"):
        EngineArgs(model=missing).create_engine_config()


def test_engine_args_model_of_the_wrong_type_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"EngineArgs\.model=42"):
        EngineArgs(model=42).create_engine_config()  # type: ignore[arg-type]


def test_vllms_names_for_engine_args_are_accepted() -> None:
    from asyncllm.async_llm import AsyncEngineArgs as from_async_llm

    assert asyncllm.AsyncEngineArgs is EngineArgs is from_async_llm
    assert "AsyncEngineArgs" in asyncllm.__all__
    for eager in (True, False):  # always eager here: both hold as asked
        EngineArgs(enforce_eager=eager).validate()
    with pytest.raises(ConfigError, match=r"EngineArgs\.enforce_eager='yes'"):
        EngineArgs(enforce_eager="yes").validate()  # type: ignore[arg-type]


def test_long_prefill_token_threshold_reaches_the_scheduler_and_is_checked(model_path: str) -> None:
    config = EngineArgs(model=model_path, load_format="dummy", long_prefill_token_threshold=256).create_engine_config()
    assert config.scheduler.long_prefill_token_threshold == 256
    assert (
        EngineArgs(model=model_path, load_format="dummy").create_engine_config().scheduler.long_prefill_token_threshold
        == 0
    )
    for bad in (-1, 2.5, True):
        with pytest.raises(ConfigError, match=r"EngineArgs\.long_prefill_token_threshold="):
            EngineArgs(long_prefill_token_threshold=bad).validate()  # type: ignore[arg-type]
