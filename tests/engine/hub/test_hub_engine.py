"""A Hub id where a path went: the loaders (engine/loading/checkpoint.py), the engine and `duet generate` take it,
with huggingface_hub's settings (``HubSettings.from_env``) pointing at the local Hub."""
from __future__ import annotations

import dataclasses

import pytest

from cluster.cli import main
from engine.hub.resolve import HubSettings, pin_model
from engine.loading.checkpoint import load_model_config, load_tokenizer
from engine.loading.paths import checkpoint_name
from tests.engine.hub.hub_repos import GGUF, LLAMA


@pytest.fixture
def hub_env_settings(settings, monkeypatch):
    monkeypatch.setattr(HubSettings, "from_env", classmethod(lambda cls: settings))
    return settings


def test_loaders_take_a_hub_id_and_name_the_model_by_its_pinned_id(fake_hub, hub_env_settings, hub_models):
    pinned = pin_model(f"{LLAMA}@v1")
    config = load_model_config(pinned)
    assert config.model_id == pinned == f"{LLAMA}@{fake_hub.old}"  # every worker of one commit agrees
    local = load_model_config(hub_models[0])
    assert dataclasses.replace(config, model_id=local.model_id) == local  # the same checkpoint otherwise
    assert load_tokenizer(pinned).encode("hello world") == load_tokenizer(hub_models[0]).encode("hello world")
    assert checkpoint_name(pinned) == LLAMA
    gguf = pin_model(f"{GGUF}:Q8_0")
    assert load_model_config(gguf).model_id == gguf and gguf.endswith(":tiny-llama-Q8_0.gguf")


def test_duet_generate_on_a_hub_id_equals_the_local_checkpoint(fake_hub, hub_env_settings, hub_models, capsys):
    args = ["--prompt", "The quick brown fox", "--max-tokens", "12", "--num-blocks", "64"]
    assert main(["generate", "--model", str(hub_models[0]), *args]) == 0
    local = capsys.readouterr().out
    assert main(["generate", "--model", f"{LLAMA}@v1", *args]) == 0
    assert capsys.readouterr().out == local
    assert main(["generate", "--model", LLAMA, *args]) == 0  # main: the seed-1 model, another continuation
    assert capsys.readouterr().out != local


def test_neither_a_path_nor_a_hub_id_is_a_clear_cli_error(capsys):
    assert main(["generate", "--model", "tiny-llama", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "duet: error: model 'tiny-llama': no such file or directory, and not a Hugging Face Hub id " \
           "(org/name[@revision][:QUANT | :file.gguf])" in err
