"""What a --model string names (engine/hub/ref.py): a local path always wins; a Hub id's parts; anything else an error
naming both readings."""
from __future__ import annotations

import pytest

from engine.errors import ModelLoadError
from engine.hub.ref import HubRef, is_hub_id, parse_hub_ref, parse_model, served_name
from engine.loading.paths import checkpoint_name

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize("text, repo, revision, selector", [
    ("org/name", "org/name", None, None),
    ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B", None, None),
    ("org/name@v1.0", "org/name", "v1.0", None),
    ("org/name@refs/pr/3", "org/name", "refs/pr/3", None),
    (f"org/name@{COMMIT}", "org/name", COMMIT, None),
    ("org/name-GGUF:Q4_K_M", "org/name-GGUF", None, "Q4_K_M"),
    ("org/name-GGUF:UD-Q4_K_XL", "org/name-GGUF", None, "UD-Q4_K_XL"),
    ("org/name-GGUF:sub/model.Q8_0.gguf", "org/name-GGUF", None, "sub/model.Q8_0.gguf"),
    ("org/name@main:Q8_0", "org/name", "main", "Q8_0"),
])
def test_hub_ids_parse_into_repo_revision_selector(text, repo, revision, selector):
    ref = parse_hub_ref(text)
    assert ref == HubRef(repo, revision, selector)
    assert str(ref) == text  # the string form round-trips: what workers receive
    assert served_name(text) == checkpoint_name(text) == repo


@pytest.mark.parametrize("text", [
    "gpt2",                    # no organisation: could be a typo'd relative path
    "/models/missing",         # an absolute path that does not exist
    "./org/name", "org/name/extra", "org//name", "org/-name", "org/name.", "org--x/name", "org/na..me",
    "org/name@", "org/name:", "org/name@v 1", "org/name:Q4@main",  # the revision comes before the quant
    "",
])
def test_malformed_ids_are_none_and_parse_model_says_both_readings_failed(text):
    assert parse_hub_ref(text) is None
    with pytest.raises(ModelLoadError, match="no such file or directory, and not a Hugging Face Hub id"):
        parse_model(text)


def test_existing_path_wins_over_a_hub_reading(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_model("org/name") is None and not is_hub_id("org/name")
    assert checkpoint_name("org/name") == "name"  # a local directory: its name, as before
    assert parse_model("org/other") == HubRef("org/other")


def test_pinned_means_a_full_commit_hash():
    assert HubRef("o/n", COMMIT).is_pinned
    assert not HubRef("o/n", "main").is_pinned and not HubRef("o/n", COMMIT[:12]).is_pinned
    pinned = HubRef("o/n", "main", "Q8_0").pinned(COMMIT, "n.Q8_0.gguf")
    assert str(pinned) == f"o/n@{COMMIT}:n.Q8_0.gguf" and pinned.selects_file
