"""Hub ids resolved through huggingface_hub against a local Hub (tests/engine/hub/fake_hub.py): the files fetched,
the cache huggingface_hub writes, pinning, offline mode, an unreachable Hub, and each error a user can meet."""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os

import pytest

from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.hub.ref import parse_hub_ref
from engine.hub.resolve import hub_env, local_checkpoint, pin_engine_config, pin_model, resolve
from tests.engine.hub.hub_repos import GATED, GGUF, LLAMA, PICKLES, PRIVATE, SHARDED, TOKEN
from tests.ports import free_port

ENGINE_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "model.safetensors"}


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_main_fetches_the_engine_files_into_huggingface_hubs_cache_layout(fake_hub, settings, hub_models):
    resolved = resolve(parse_hub_ref(LLAMA), settings)
    assert resolved.commit == fake_hub.new and resolved.path == resolved.snapshot
    assert set(fake_hub.files_requested(LLAMA)) == ENGINE_FILES  # never the pickle, the README or original/
    assert fake_hub.api_calls(LLAMA) == [f"/api/models/{LLAMA}/revision/main"]
    repo = settings.cache_dir / "models--duet-test--tiny-llama"
    assert (repo / "refs" / "main").read_text() == fake_hub.new
    snap = repo / "snapshots" / fake_hub.new
    assert snap == resolved.snapshot and {p.name for p in snap.iterdir()} == ENGINE_FILES
    for f in snap.iterdir():  # each a relative symlink into blobs/, named by its etag (sha256 for LFS files)
        assert f.is_symlink() and os.readlink(f).startswith("../../blobs/")
    weights = snap / "model.safetensors"
    assert weights.resolve().name == sha(weights) == sha(hub_models[1] / "model.safetensors")


def test_a_tag_or_commit_picks_the_older_commit_and_pins_it(fake_hub, settings, hub_models):
    pinned = pin_model(f"{LLAMA}@v1", settings)
    assert pinned == f"{LLAMA}@{fake_hub.old}"
    path = local_checkpoint(pinned, settings)
    assert sha(path / "model.safetensors") == sha(hub_models[0] / "model.safetensors")
    assert (settings.cache_dir / "models--duet-test--tiny-llama" / "refs" / "v1").read_text() == fake_hub.old
    fake_hub.requests.clear()
    assert local_checkpoint(pinned, settings) == path and fake_hub.requests == []  # pinned and cached: no request
    assert pin_model(f"{LLAMA}@{fake_hub.old}", settings) == pinned and fake_hub.requests == []
    assert pin_model(f"{LLAMA}@v1", settings) == pinned  # a tag can move: asked again, files not fetched again
    assert fake_hub.api_calls(LLAMA) == [f"/api/models/{LLAMA}/revision/v1"] and not fake_hub.files_requested(LLAMA)


def test_a_worker_with_an_empty_cache_fetches_exactly_the_pinned_commit(fake_hub, settings, tmp_path, hub_models):
    pinned = pin_model(f"{LLAMA}@v1", settings)
    fake_hub.requests.clear()
    other_node = dataclasses.replace(settings, cache_dir=tmp_path / "other-node-cache")
    path = local_checkpoint(pinned, other_node)
    assert fake_hub.api_calls(LLAMA) == [f"/api/models/{LLAMA}/revision/{fake_hub.old}"]
    assert sha(path / "model.safetensors") == sha(hub_models[0] / "model.safetensors")  # not main's


def test_sharded_repo_fetches_the_index_then_its_shards_only(fake_hub, settings):
    resolved = resolve(parse_hub_ref(SHARDED), settings)
    got = fake_hub.files_requested(SHARDED)
    assert got[-3:] == ["model.safetensors.index.json", "model-00001-of-00002.safetensors",
                        "model-00002-of-00002.safetensors"]
    assert "consolidated.safetensors" not in got
    from engine.loading.checkpoint import load_model_config

    assert load_model_config(resolved.path).num_layers == 2


@pytest.mark.parametrize("selector, file", [("Q8_0", "tiny-llama-Q8_0.gguf"), ("f16", "tiny-llama-F16.gguf"),
                                            ("tiny-llama-F16.gguf", "tiny-llama-F16.gguf")])
def test_gguf_repo_fetches_the_one_file_chosen(fake_hub, settings, hub_models, selector, file):
    pinned = pin_model(f"{GGUF}:{selector}", settings)
    commit = fake_hub.repos[GGUF].refs["main"]
    assert pinned == f"{GGUF}@{commit}:{file}"
    assert fake_hub.files_requested(GGUF) == [file]
    path = local_checkpoint(pinned, settings)
    assert path.name == file and sha(path) == sha(hub_models[3][file.split("-")[-1].removesuffix(".gguf")])


def test_offline_serves_the_cache_without_a_request(fake_hub, settings):
    online = pin_model(f"{GGUF}:Q8_0", settings), pin_model(f"{LLAMA}@v1", settings), pin_model(LLAMA, settings)
    offline = dataclasses.replace(settings, offline=True)
    fake_hub.requests.clear()
    assert (pin_model(f"{GGUF}:Q8_0", offline), pin_model(f"{LLAMA}@v1", offline), pin_model(LLAMA, offline)) == online
    assert fake_hub.requests == []
    with pytest.raises(ModelLoadError, match=rf"{SHARDED}@main is not in the Hugging Face cache .*hf-cache, and "
                                             "HF_HUB_OFFLINE=1 forbids fetching it"):
        pin_model(SHARDED, offline)
    with pytest.raises(ModelLoadError, match=r"no GGUF file matches quantization 'F16' \(its GGUF files: "
                                             r"tiny-llama-Q8_0.gguf\)"):  # the cache holds what was fetched
        pin_model(f"{GGUF}:F16", offline)


def test_unreachable_hub_falls_back_to_the_cache_logged_or_says_both(fake_hub, settings, caplog):
    pinned = pin_model(LLAMA, settings)
    down = dataclasses.replace(settings, endpoint=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="engine.hub.resolve"):
        assert pin_model(LLAMA, down) == pinned
    assert f"cannot reach {down.endpoint}" in caplog.text and f"cached snapshot {fake_hub.new}" in caplog.text
    with pytest.raises(ModelLoadError, match=rf"cannot reach {down.endpoint} \(ConnectError.*\), and {SHARDED}@main "
                                             "is not in the Hugging Face cache"):
        pin_model(SHARDED, down)


def test_gated_repo_says_accept_the_terms_and_set_hf_token(fake_hub, settings):
    with pytest.raises(ModelLoadError, match=rf"{GATED} is a gated model \(HTTP 401\) and no token is set: accept its "
                                             rf"terms on {fake_hub.endpoint}/{GATED} .* set HF_TOKEN"):
        pin_model(GATED, settings)
    with pytest.raises(ModelLoadError, match=r"gated model \(HTTP 403\) and the token in use has no access"):
        pin_model(GATED, dataclasses.replace(settings, token="hf_other"))
    assert pin_model(GATED, dataclasses.replace(settings, token=TOKEN)).startswith(f"{GATED}@")


def test_private_or_unknown_repo_and_unknown_revision_name_what_is_missing(fake_hub, settings, monkeypatch):
    with pytest.raises(ModelLoadError, match=rf"{PRIVATE}: no such model repository on {fake_hub.endpoint}, or it is "
                                             r"private or gated and no token is set \(HF_TOKEN\) \(HTTP 401\)"):
        pin_model(PRIVATE, settings)
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # huggingface_hub's own token lookup
    assert pin_model(PRIVATE, settings).startswith(f"{PRIVATE}@")
    with pytest.raises(ModelLoadError, match=r"duet-test/nope: no such model repository .*token in use has no access "
                                             r"\(HTTP 404\); and no local path 'duet-test/nope' exists"):
        pin_model("duet-test/nope", settings)
    with pytest.raises(ModelLoadError, match=rf"{LLAMA} has no revision 'v9' \(HTTP 404\)"):
        pin_model(f"{LLAMA}@v9", settings)


def test_repo_without_weights_duet_reads_lists_its_files(fake_hub, settings):
    with pytest.raises(ModelLoadError, match=rf"{PICKLES}@main: no weights in a format duet reads.*pickled weights "
                                             r"\(pytorch_model.bin\) are never loaded \(its files: config.json, "
                                             r"pytorch_model.bin, tokenizer.json\)"):
        pin_model(PICKLES, settings)
    assert fake_hub.files_requested(PICKLES) == []
    with pytest.raises(ModelLoadError, match=r"no GGUF file matches quantization 'Q4_K_M' \(its GGUF files: tiny-llama-F16.gguf, "
                                             r"tiny-llama-Q8_0.gguf\)"):
        pin_model(f"{GGUF}:Q4_K_M", settings)


def test_local_paths_are_untouched_and_workers_get_hf_env_only_for_hub_ids(tiny_model, monkeypatch):
    path = tiny_model("llama")
    assert pin_model(str(path)) == str(path) and local_checkpoint(str(path)) == path
    local = EngineConfig(model=str(path))
    assert pin_engine_config(local) is local
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    assert hub_env(local) == {}
    env = hub_env(EngineConfig(model=LLAMA))
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_TOKEN"] == "hf_x" and all(k.startswith("HF_") for k in env)


def test_a_speculative_draft_model_on_the_hub_is_pinned_too(fake_hub, settings, tiny_model, monkeypatch):
    config = EngineConfig(model=str(tiny_model("llama")), speculative_config={
        "method": "draft_model", "model": f"{LLAMA}@v1", "num_speculative_tokens": 2})
    pinned = pin_engine_config(config, settings)
    assert pinned.model == config.model and pinned.speculative_config.model == f"{LLAMA}@{fake_hub.old}"
    monkeypatch.setenv("HF_HUB_CACHE", "/data/hf")
    assert hub_env(config)["HF_HUB_CACHE"] == "/data/hf"  # the draft's workers resolve it with these settings
