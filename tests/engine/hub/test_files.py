"""Which files of a repository duet fetches (engine/hub/files.py): the engine's files only, one GGUF by tag or name,
and every refusal naming the files the repository has."""
from __future__ import annotations

import json
import logging

import pytest

from engine.errors import ModelLoadError
from engine.hub.files import index_shards, select_files

WHERE = "org/name@main"
HF = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
      "chat_template.jinja", "README.md", ".gitattributes"]
GGUFS = ["m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-BF16.gguf", "m-F16.gguf", "mmproj-m-F16.gguf", "m.imatrix.gguf"]


def test_safetensors_repo_gives_the_engine_files_never_pickles_or_subfolders():
    files = HF + ["model.safetensors", "pytorch_model.bin", "consolidated.pth", "original/consolidated.safetensors",
                  "onnx/model.onnx"]
    sel = select_files(files, None, WHERE)
    assert sel.kind == "safetensors" and sel.gguf_file is None
    assert set(sel.files) == set(HF[:6]) | {"model.safetensors"}


def test_an_index_replaces_the_glob_its_shards_come_once_it_is_read(tmp_path):
    files = HF + ["model.safetensors.index.json", "model-00001-of-00002.safetensors",
                  "model-00002-of-00002.safetensors", "consolidated.safetensors"]
    sel = select_files(files, None, WHERE)
    assert "model.safetensors.index.json" in sel.files
    assert not any(f.endswith(".safetensors") for f in sel.files)  # not consolidated.safetensors, not yet shards
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                "b": "model-00002-of-00002.safetensors"}}))
    assert index_shards(index, files, WHERE) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    with pytest.raises(ModelLoadError, match=r"names shards the repository lacks: model-00002-of-00002.safetensors$"):
        index_shards(index, [f for f in files if not f.startswith("model-00002")], WHERE)


def test_no_weights_duet_reads_lists_what_the_repo_has():
    with pytest.raises(ModelLoadError, match=r"no weights in a format duet reads.*pytorch_model\.bin.*never loaded"
                                             r".*its files: .*config\.json"):
        select_files(HF + ["pytorch_model.bin"], None, WHERE)
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        select_files(["config.json", "model.safetensors"], None, WHERE)


@pytest.mark.parametrize("tag, file", [("Q4_K_M", "m-Q4_K_M.gguf"), ("q8_0", "m-Q8_0.gguf"), ("F16", "m-F16.gguf"),
                                       ("BF16", "m-BF16.gguf")])
def test_quant_tag_matches_one_file_at_a_word_boundary(tag, file):
    sel = select_files(HF + GGUFS, tag, WHERE)  # F16 must not match m-BF16 (llama.cpp's search would), nor mmproj
    assert (sel.kind, sel.files, sel.gguf_file) == ("gguf", (file,), file)


def test_file_name_selects_exactly_that_file():
    assert select_files(GGUFS + ["sub/x-Q2_K.gguf"], "sub/x-Q2_K.gguf", WHERE).gguf_file == "sub/x-Q2_K.gguf"
    with pytest.raises(ModelLoadError, match=r"no file 'nope.gguf' \(its GGUF files: m-BF16.gguf"):
        select_files(GGUFS, "nope.gguf", WHERE)


def test_tag_with_no_match_or_several_lists_the_files():
    with pytest.raises(ModelLoadError, match=r"no GGUF file matches quantization 'Q5_K_S' \(its GGUF files: "
                                             r"m-BF16.gguf, m-F16.gguf, m-Q4_K_M.gguf, m-Q8_0.gguf\)"):
        select_files(GGUFS, "Q5_K_S", WHERE)
    with pytest.raises(ModelLoadError, match=r"'Q8_0' matches several GGUF files: a/m-Q8_0.gguf, m-Q8_0.gguf; name "
                                             r"one: org/name:<file>.gguf"):
        select_files(GGUFS + ["a/m-Q8_0.gguf"], "Q8_0", WHERE)
    with pytest.raises(ModelLoadError, match="no .gguf file"):
        select_files(HF + ["model.safetensors"], "Q8_0", WHERE)


def test_no_tag_one_model_gguf_or_llama_cpp_defaults_logged(caplog):
    assert select_files(["x-Q6_K.gguf", "mmproj-x-F16.gguf"], None, WHERE).gguf_file == "x-Q6_K.gguf"
    with caplog.at_level(logging.WARNING, logger="engine.hub.files"):
        assert select_files(GGUFS, None, WHERE).gguf_file == "m-Q4_K_M.gguf"
    assert "no quantization named; taking m-Q4_K_M.gguf, llama.cpp's default" in caplog.text
    assert select_files(["a-Q8_0.gguf", "a-Q2_K.gguf"], None, WHERE).gguf_file == "a-Q8_0.gguf"
    with pytest.raises(ModelLoadError, match=r"several GGUF files and no quantization named.*a-Q2_K.gguf, a-Q3_K.gguf"):
        select_files(["a-Q2_K.gguf", "a-Q3_K.gguf"], None, WHERE)


def test_safetensors_win_without_a_tag_and_a_tag_picks_the_gguf():
    files = HF + ["model.safetensors", "m-Q8_0.gguf"]
    assert select_files(files, None, WHERE).kind == "safetensors"
    assert select_files(files, "Q8_0", WHERE).gguf_file == "m-Q8_0.gguf"


def test_split_gguf_is_refused_by_name():
    files = ["m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"]
    with pytest.raises(ModelLoadError, match="part 1 of a GGUF split in 2 files; duet reads one file"):
        select_files(files, "Q8_0", WHERE)
