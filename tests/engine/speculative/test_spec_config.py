"""``--speculative-config`` parsing (engine/config.py): vLLM's keys and defaults, duet's refusals."""
from __future__ import annotations

import dataclasses

import pytest

from engine.config import SpeculativeConfig
from engine.errors import ConfigError
from engine.speculative.decoder import make_proposer
from engine.speculative.ngram import NgramProposer
from engine.speculative.suffix import SuffixProposer

parse = SpeculativeConfig.from_json


def test_ngram_defaults_as_vllm():
    # vLLM's docs example: prompt_lookup_max only -> prompt_lookup_min follows it (vLLM's __post_init__)
    c = parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 4, 4)
    c = parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    c = parse('{"num_speculative_tokens": 3, "model": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 6}')
    assert (c.method, c.model, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", "ngram", 1, 6)
    assert not c.needs_draft_model


def test_suffix_defaults_as_vllm():
    c = parse('{"method": "suffix"}')
    assert (c.num_speculative_tokens, c.suffix_decoding_max_tree_depth, c.suffix_decoding_max_cached_requests,
            c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob) == (24, 24, 10000, 1.0, 0.1)
    assert c.suffix_decoding_max_cached_nodes == 1 << 18 and c.prompt_lookup_min is None
    c = parse('{"method": "suffix", "suffix_decoding_max_tree_depth": 32, "suffix_decoding_max_cached_requests": 0,'
              ' "suffix_decoding_max_spec_factor": 2, "suffix_decoding_min_token_prob": 0}')
    assert (c.num_speculative_tokens, c.suffix_decoding_max_cached_requests, c.suffix_decoding_max_spec_factor) == \
        (32, 0, 2)
    assert parse('{"method": "suffix", "num_speculative_tokens": 4}').num_speculative_tokens == 4


def test_draft_model_parsed_and_flagged():
    c = parse('{"model": "org/draft-1b", "num_speculative_tokens": 4}')
    assert (c.method, c.model, c.needs_draft_model, c.prompt_lookup_min) == ("draft_model", "org/draft-1b", True, None)
    assert parse('{"method": "draft_model", "model": "d", "num_speculative_tokens": 2}') == \
        SpeculativeConfig.from_dict({"method": "draft_model", "model": "d", "num_speculative_tokens": 2})


@pytest.mark.parametrize("text, key", [
    ('{"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}', "draft_tensor_parallel_size"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup": 2}', "prompt_lookup"),
    ('{"method": "eagle", "model": "x", "num_speculative_tokens": 3}', "method"),
    ('{"method": null}', "method"),
    ('{"num_speculative_tokens": 3}', "method"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "draft_model", "model": "x"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}', "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": -1}', "prompt_lookup_max"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "model": "org/draft"}', "model"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "model"),
    ('{"method": "draft_model", "model": "", "num_speculative_tokens": 3}', "model"),
    ('{"method": "suffix", "prompt_lookup_max": 3}', "prompt_lookup_max"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 8}',
     "suffix_decoding_max_tree_depth"),
    ('{"method": "suffix", "suffix_decoding_max_tree_depth": 0}', "suffix_decoding_max_tree_depth"),
    ('{"method": "suffix", "suffix_decoding_max_cached_requests": -1}', "suffix_decoding_max_cached_requests"),
    ('{"method": "suffix", "suffix_decoding_max_cached_nodes": 0}', "suffix_decoding_max_cached_nodes"),
    ('{"method": "suffix", "suffix_decoding_max_spec_factor": -0.5}', "suffix_decoding_max_spec_factor"),
    ('{"method": "suffix", "suffix_decoding_max_spec_factor": Infinity}', "suffix_decoding_max_spec_factor"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}', "suffix_decoding_min_token_prob"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": NaN}', "suffix_decoding_min_token_prob"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": "0.1"}', "suffix_decoding_min_token_prob"),
])
def test_refusals_name_the_key(text, key):
    with pytest.raises(ConfigError, match=key):
        parse(text)


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", '"ngram"', "null"])
def test_refusals_of_non_objects(text):
    with pytest.raises(ConfigError, match="speculative config"):
        parse(text)


def test_frozen_and_validated_on_construction():
    c = parse('{"method": "ngram", "num_speculative_tokens": 3}')
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_speculative_tokens = 4
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        dataclasses.replace(c, prompt_lookup_min=9)
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=3)  # the dataclass takes no defaults for ngram


def test_make_proposer_from_config():
    ng = make_proposer(SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3}))
    assert isinstance(ng, NgramProposer) and (ng.min_n, ng.max_n, ng.num_speculative_tokens) == (5, 5, 3)
    sf = make_proposer(SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_cached_requests": 7}))
    assert isinstance(sf, SuffixProposer) and sf.num_speculative_tokens == 24 and sf.cache.max_requests == 7
    with pytest.raises(NotImplementedError, match="draft model"):
        make_proposer(SpeculativeConfig.from_dict({"model": "org/draft", "num_speculative_tokens": 3}))
