"""`asyncllm serve --enable-lora --lora-modules NAME=PATH`: the adapter is a model of its own (listed, routed, its
own output), the base model is unchanged, and an unknown name is a 400 naming the served ones."""

from __future__ import annotations

import pathlib
import signal
from collections.abc import Iterator

import httpx
import pytest

from asyncllm.model.loading.loader import read_arch_config
from tests.lora_adapters import write_peft_adapter
from tests.server.server_helpers import ServerProcess, start_server, stop_server

pytestmark = [pytest.mark.mp, pytest.mark.slow]


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[ServerProcess]:
    adapter = tmp_path_factory.mktemp("lora") / "sql"
    write_peft_adapter(pathlib.Path(adapter), read_arch_config(model_path), seed=0)
    args = ["--enable-lora", "--max-lora-rank", "8", "--num-kv-blocks", "64", "--lora-modules", f"sql={adapter}"]
    proc = start_server(*args)
    yield proc
    assert stop_server(proc) in (0, -signal.SIGTERM), proc.log()


def complete(base_url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)


def test_the_adapter_is_a_model_of_its_own(lora_server: ServerProcess) -> None:
    url = lora_server.base_url
    models = httpx.get(f"{url}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["smollm2-135m-instruct", "sql"]
    base, adapted, again = (complete(url, name) for name in ("smollm2-135m-instruct", "sql", "sql"))
    assert adapted.json()["model"] == "sql"
    assert adapted.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]
    assert adapted.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]
    unknown = complete(url, "nope")
    assert unknown.status_code == 400
    assert "['smollm2-135m-instruct', 'sql']" in unknown.json()["error"]["message"]
