"""Tenant isolation over HTTP (issue 23): the official `openai` client against real uvicorn servers over
LocalBackend on a tiny model. A prefix-cache hit shows as ``usage.prompt_tokens_details.cached_tokens``:
it must be 0 across salts (client ``cache_salt`` or the API key's salt) and > 0 within one."""
from __future__ import annotations

import itertools

import openai
import pytest

from router.http.app import create_app
from router.tenancy import bearer_token, tenant_salt
from tests.router.http.http_harness import ServerThread, assert_error_shape
from tests.router.http.test_app import served  # noqa: F401  (the module's server fixture)

KEYS = ("key-of-tenant-a", "key-of-tenant-b")
_fresh = itertools.count()


def fresh_prompt() -> str:
    """A prompt no other test sent (so the cache holds nothing of it yet), several blocks long."""
    return f"case {next(_fresh)} of tenant isolation: " + "the river runs past the mill below the mountain " * 4


def client_for(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def complete(client, prompt: str, salt: str | None = None, **kw):
    extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt is not None else {})
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, extra_body=extra, **kw)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def chat(client, prompt: str, salt: str | None = None):
    extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt is not None else {})
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=4,
                                       temperature=0, extra_body=extra)
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def tenants_url(served):  # noqa: F811
    """The same backend behind an app that salts by API key."""
    with ServerThread(create_app(served.backend, api_keys=KEYS, salt_by_api_key=True)) as server:
        yield server.url


@pytest.mark.parametrize("call", [complete, chat], ids=["completions", "chat"])
def test_cache_salt_confines_prefix_hits_to_the_same_salt(served, call):  # noqa: F811
    prompt = fresh_prompt()
    text, cached = call(served.client, prompt, "salt-a")
    assert cached == 0
    again_text, again_cached = call(served.client, prompt, "salt-a")
    assert again_cached > 0 and again_text == text  # the same salt hits
    # another salt, or none, does not; the salt changes where KV is shared, never the output
    assert call(served.client, prompt, "salt-b") == (text, 0)
    assert call(served.client, prompt) == (text, 0)
    assert call(served.client, prompt, "salt-b")[1] > 0 and call(served.client, prompt)[1] > 0


def test_cache_salt_streamed_usage_reports_the_same_hits(served):  # noqa: F811
    prompt = fresh_prompt()
    complete(served.client, prompt, "s")
    *_, usage_chunk = served.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, stream=True, stream_options={"include_usage": True},
        extra_body={"cache_salt": "s"})
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens > 0
    *_, usage_chunk = served.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, stream=True, stream_options={"include_usage": True},
        extra_body={"cache_salt": "t"})
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("salt", ["", "x" * 257, 5, ["a"], {"a": "b"}, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_cache_salt_is_a_400_naming_it(served, path, salt):  # noqa: F811
    body = {"model": "tiny", "max_tokens": 2, "cache_salt": salt}
    body |= {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = served.http.post(served.url + path, json=body)
    assert r.status_code == 400, r.text
    assert assert_error_shape(r.json())["param"] == "cache_salt"


def test_the_openai_client_sees_a_bad_cache_salt_as_bad_request(served):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as err:
        served.client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"cache_salt": ""})
    assert err.value.status_code == 400 and "cache_salt" in err.value.message
    # null means absent, as for every other field; the longest salt is fine
    r = served.http.post(served.url + "/v1/completions",
                         json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "cache_salt": None})
    assert r.status_code == 200, r.text
    assert complete(served.client, fresh_prompt(), "x" * 256)[1] == 0


def test_api_keys_are_cache_domains_when_salting_by_key(tenants_url):
    a, b = client_for(tenants_url, KEYS[0]), client_for(tenants_url, KEYS[1])
    prompt = fresh_prompt()
    text, cached = complete(a, prompt)
    assert cached == 0
    assert complete(a, prompt)[1] > 0  # the same key hits
    assert complete(b, prompt) == (text, 0)  # the other key does not, and gets the same text
    assert complete(b, prompt)[1] > 0
    # the client's cache_salt applies within the key's domain: both must match for a hit
    assert complete(a, prompt, "shared-salt")[1] == 0
    assert complete(b, prompt, "shared-salt")[1] == 0
    assert complete(a, prompt, "shared-salt")[1] > 0
    assert chat(b, prompt)[1] == 0 and chat(a, prompt)[1] == 0 and chat(a, prompt)[1] > 0


def test_unsalted_servers_share_across_keys(served):  # noqa: F811
    """Without salt_by_api_key (the default) keys share the cache: the option is what isolates them."""
    with ServerThread(create_app(served.backend, api_keys=KEYS)) as server:
        prompt = fresh_prompt()
        assert complete(client_for(server.url, KEYS[0]), prompt)[1] == 0
        assert complete(client_for(server.url, KEYS[1]), prompt)[1] > 0


def test_salting_by_key_needs_keys_and_a_key_is_never_its_salt(served):  # noqa: F811
    with pytest.raises(ValueError, match="salt_by_api_key needs api_keys"):
        create_app(served.backend, salt_by_api_key=True)
    salts = {tenant_salt(k) for k in (*KEYS, KEYS[0])}
    assert len(salts) == 2 and all(len(s) == 32 and not any(k in s for k in KEYS) for s in salts)
    assert (bearer_token("Bearer  k1 "), bearer_token("bearer k1"), bearer_token("Basic k1")) == ("k1", "k1", None)


def test_the_openapi_document_describes_cache_salt(served):  # noqa: F811
    schemas = served.http.get(served.url + "/openapi.json").json()["components"]["schemas"]
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        [string, null] = schemas[model]["properties"]["cache_salt"]["anyOf"]
        assert (string["type"], string["minLength"], string["maxLength"], null["type"]) == ("string", 1, 256, "null")
