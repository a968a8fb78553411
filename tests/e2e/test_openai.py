"""POST /v1/completions through the official `openai` Python client, unchanged: plain and streamed
answers, n > 1 and batched prompts, vLLM-style logprobs with "token_id:N" keys, echo scoring, seeds,
stop tokens, errors surfacing as the client's own exception types, and the API key.

The embedded default model has random weights (vocab 8192): tests check shapes, consistency with
/generate (same seed, same tokens and logprobs) and reproducibility, never particular tokens.
"""
import math

import openai
import pytest
import requests

from conftest import FIXTURES, Daemon

PROMPT = [11, 22, 33, 44, 55]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(None, ["--kv-cache-mb", "128"], tmp_path_factory.mktemp("openai") / "rolloutd.log")
    yield d
    rc = d.stop()
    assert rc == 0, f"rolloutd exited with {rc}:\n{d.read_log()[-4000:]}"


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=120)


def complete(client, **kw):
    kw.setdefault("model", "default")
    return client.completions.create(**kw)


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["default"]


def test_plain_completion(client):
    r = complete(client, prompt=[[1, 2, 3]], max_tokens=8, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.id.startswith("cmpl-")
    assert r.object == "text_completion"
    assert r.model == "default"
    assert isinstance(r.created, int) and r.created > 1_600_000_000
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.finish_reason == "length" and c.logprobs is None
    # the default model has a tokenizer.json: the text is the output decoded (tests/e2e/test_text_api.py
    # checks it against Hugging Face tokenizers)
    assert isinstance(c.text, str) and c.text
    assert len(c.token_ids) == 8 and all(0 <= t < 8192 for t in c.token_ids)
    assert c.prompt_token_ids == [1, 2, 3]
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 8 and r.usage.total_tokens == 11


def test_default_max_tokens_is_16(client):
    r = complete(client, prompt=PROMPT, extra_body={"ignore_eos": True})
    assert len(r.choices[0].token_ids) == 16


def test_n_and_batched_prompts(client):
    prompts = [[1, 2], [3, 4, 5]]
    r = complete(client, prompt=prompts, n=3, max_tokens=4, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(6))  # prompt-major: index = prompt * n + sample
    assert all(len(c.token_ids) == 4 for c in r.choices)
    assert r.usage.prompt_tokens == 5  # each prompt counted once
    assert r.usage.completion_tokens == 24
    assert len({tuple(c.token_ids) for c in r.choices[:3]}) > 1  # samples differ


def test_logprobs_vllm_shape(client):
    k = 3
    r = complete(client, prompt=PROMPT, max_tokens=6, logprobs=k, temperature=1.0, seed=3,
                 extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    c = r.choices[0]
    lp = c.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in c.token_ids]
    assert len(lp.token_logprobs) == 6 and all(x <= 0 and math.isfinite(x) for x in lp.token_logprobs)
    assert len(lp.top_logprobs) == 6
    for tok, lpv, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tok in top and top[tok] == pytest.approx(lpv)  # the sampled token is always listed
        assert k <= len(top) <= k + 1
        assert all(key.startswith("token_id:") for key in top)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    r0 = complete(client, prompt=PROMPT, max_tokens=2, logprobs=0)
    assert all(len(top) == 1 for top in r0.choices[0].logprobs.top_logprobs)  # logprobs 0: the sampled token


def test_same_tokens_and_logprobs_as_generate(client, daemon):
    r = complete(client, prompt=PROMPT, max_tokens=10, logprobs=0, temperature=1.0, seed=1234,
                 extra_body={"ignore_eos": True})
    g = daemon.post("/generate", {"input_ids": PROMPT, "return_logprob": True,
                                  "sampling_params": {"max_new_tokens": 10, "temperature": 1.0,
                                                      "sampling_seed": 1234, "ignore_eos": True}}).json()
    assert r.choices[0].token_ids == g["output_ids"]
    assert r.choices[0].logprobs.token_logprobs == pytest.approx([x[0] for x in g["meta_info"]["output_token_logprobs"]])


def test_seeds(client):
    a = complete(client, prompt=PROMPT, max_tokens=12, seed=99, extra_body={"ignore_eos": True}).choices[0].token_ids
    b = complete(client, prompt=PROMPT, max_tokens=12, seed=99, extra_body={"ignore_eos": True}).choices[0].token_ids
    assert a == b
    # without a seed every request draws its own (OpenAI semantics)
    c = complete(client, prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True}).choices[0].token_ids
    d = complete(client, prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True}).choices[0].token_ids
    assert c != d
    g1 = complete(client, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].token_ids
    g2 = complete(client, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].token_ids
    assert g1 == g2


def test_stop_token_ids(client):
    base = complete(client, prompt=PROMPT, max_tokens=12, seed=5, extra_body={"ignore_eos": True}).choices[0]
    ids = base.token_ids
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    r = complete(client, prompt=PROMPT, max_tokens=12, seed=5, extra_body={"ignore_eos": True,
                                                                           "stop_token_ids": [ids[k]]}).choices[0]
    assert r.token_ids == ids[:k + 1]
    assert r.finish_reason == "stop" and r.model_extra["stop_reason"] == ids[k]


def test_echo_scores_the_prompt(client, daemon):
    r = complete(client, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                 extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert r.choices[0].token_ids == []
    assert lp.tokens == [f"token_id:{t}" for t in PROMPT]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    g = daemon.post("/generate", {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                                  "sampling_params": {"max_new_tokens": 0}}).json()
    assert lp.token_logprobs[1:] == pytest.approx([x[0] for x in g["meta_info"]["input_token_logprobs"][1:]])


def test_streaming(client):
    kw = dict(prompt=PROMPT, max_tokens=10, seed=11, logprobs=1, extra_body={"ignore_eos": True})
    plain = complete(client, **kw).choices[0]
    stream = complete(client, stream=True, stream_options={"include_usage": True}, **kw)
    ids, lps, finishes, usage, ids_seen = [], [], [], None, set()
    for chunk in stream:
        assert chunk.object == "text_completion" and chunk.id.startswith("cmpl-")
        ids_seen.add(chunk.id)
        if not chunk.choices:
            usage = chunk.usage
            continue
        c = chunk.choices[0]
        ids += c.token_ids
        lps += c.logprobs.token_logprobs
        finishes.append(c.finish_reason)
    assert len(ids_seen) == 1
    assert ids == plain.token_ids and lps == pytest.approx(plain.logprobs.token_logprobs)
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert usage.completion_tokens == 10 and usage.prompt_tokens == len(PROMPT)


def test_streaming_n(client):
    stream = complete(client, prompt=[[1, 2], [3]], n=2, max_tokens=5, seed=2, stream=True,
                      extra_body={"ignore_eos": True})
    got = {i: [] for i in range(4)}
    done = set()
    for chunk in stream:
        c = chunk.choices[0]
        assert c.index not in done
        got[c.index] += c.token_ids
        if c.finish_reason:
            done.add(c.index)
    assert done == {0, 1, 2, 3}
    plain = complete(client, prompt=[[1, 2], [3]], n=2, max_tokens=5, seed=2, extra_body={"ignore_eos": True})
    assert [got[i] for i in range(4)] == [c.token_ids for c in plain.choices]


def test_max_tokens_null_is_the_default(rolloutd):
    """max_tokens null (what the openai client sends for max_tokens=None) is the default, 16, as
    current vLLM reads it (CompletionRequest.normalize_null_max_tokens), lowered to the room the
    context leaves; a prompt that leaves none is a 400 naming it, not an empty completion."""
    d = rolloutd(None, "--kv-cache-mb", "64", "--max-context", "40")
    c = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0)
    r = c.completions.create(model="default", prompt=PROMPT, max_tokens=None, extra_body={"ignore_eos": True})
    assert len(r.choices[0].token_ids) == 16
    r = c.completions.create(model="default", prompt=list(range(1, 31)), max_tokens=None,
                             extra_body={"ignore_eos": True})
    assert len(r.choices[0].token_ids) == 10  # 40 - 30: the room left
    for prompt in ([list(range(1, 41))], [[1, 2, 3], list(range(1, 41))]):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="default", prompt=prompt, max_tokens=None)
        err = e.value.body if isinstance(e.value.body, dict) and "param" in e.value.body else e.value.body["error"]
        assert err["param"].startswith("prompt") and "context" in err["message"], err


def test_stream_options_the_client_sends(client):
    """stream_options.include_obfuscation is in the openai client's own type: accepted, no effect."""
    chunks = list(complete(client, prompt=PROMPT, max_tokens=3, stream=True,
                           stream_options={"include_usage": True, "include_obfuscation": False},
                           extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 3


@pytest.mark.parametrize("kw,param,etype", [
    (dict(prompt="hello " * 3000, max_tokens=1), "prompt", "invalid_request"),  # its tokens are over the context
    (dict(prompt=[]), "prompt", "invalid_request"),
    (dict(prompt=[1, 9000]), "prompt", "invalid_request"),  # outside the vocabulary
    (dict(prompt=[1], max_tokens=-1), "max_tokens", "invalid_request"),
    (dict(prompt=[1], max_tokens=40000), "max_tokens", "invalid_request"),
    (dict(prompt=[1], max_tokens=4096), "prompt", "invalid_request"),  # over the context
    (dict(prompt=[1], logprobs=21), "logprobs", "invalid_request"),
    (dict(prompt=[1], n=65), "n", "invalid_request"),
    (dict(prompt=[1], temperature=-1), "temperature", "invalid_request"),
    (dict(prompt=[1], top_p=0), "top_p", "invalid_request"),
    (dict(prompt=[1], frequency_penalty=2.5), "frequency_penalty", "invalid_request"),
    (dict(prompt=[1], presence_penalty=-2.5), "presence_penalty", "invalid_request"),
    (dict(prompt=[1], extra_body={"repetition_penalty": 0}), "repetition_penalty", "invalid_request"),
    (dict(prompt=[1], extra_body={"use_beam_search": True}), "use_beam_search", "unsupported"),
    (dict(prompt=[1], logit_bias={"5": 1}), "logit_bias", "unsupported"),
    (dict(prompt=""), "prompt", "invalid_request"),
    (dict(prompt=["a", ""]), "prompt[1]", "invalid_request"),
    (dict(prompt=["a", [1]]), "prompt[1]", "invalid_request"),
    (dict(prompt="a", stop=["x"] * 65), "stop[64]", "invalid_request"),
    (dict(prompt=[1], best_of=3), "best_of", "unsupported"),
    (dict(prompt=[1], extra_body={"bogus": 1}), "bogus", "invalid_request"),
    (dict(prompt=[1], extra_body={"stop_token_ids": [9000]}), "stop_token_ids", "invalid_request"),
    (dict(prompt=[1], extra_body={"min_tokens": 50}, max_tokens=4), "min_tokens", "invalid_request"),
])
def test_errors_are_bad_request(client, kw, param, etype):
    with pytest.raises(openai.BadRequestError) as ei:
        complete(client, **kw)
    err = ei.value.body if isinstance(ei.value.body, dict) and "param" in ei.value.body else ei.value.body["error"]
    assert err["param"] == param
    assert err["type"] == etype
    assert ei.value.status_code == 400
    assert ei.value.code == "400"  # the client types APIStatusError.code as a string, read from the body


def test_string_prompt_without_a_tokenizer(rolloutd):
    """A model directory without tokenizer.json serves token ids; text is a 400 saying why."""
    d = rolloutd(FIXTURES / "models" / "qwen3", "--kv-cache-mb", "64", "--served-model-name", "default")
    c = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as ei:
        complete(c, prompt="hello")
    assert "rolloutd takes token ids (no tokenizer configured)" in str(ei.value)
    assert "tokenizer.json" in str(ei.value)
    with pytest.raises(openai.BadRequestError) as ei:
        complete(c, prompt=[1, 2], stop=["x"])
    assert "no tokenizer.json" in str(ei.value)
    assert complete(c, prompt=[1, 2], max_tokens=2).choices[0].text == ""
    info = d.get("/get_model_info").json()
    assert info["tokenizer_path"] is None
    for path, body, param in [("/generate", {"text": "hi"}, "text"),
                              ("/generate", {"input_ids": [1], "return_text_in_logprobs": True},
                               "return_text_in_logprobs"),
                              ("/generate", {"input_ids": [1], "sampling_params": {"stop": "x"}},
                               "sampling_params.stop"),
                              ("/tokenize", {"prompt": "hi"}, "prompt"),
                              ("/detokenize", {"tokens": [1]}, "tokens")]:
        r = d.post(path, body)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "no tokenizer.json" in err["message"], err
    r = d.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and "text" not in r.json()


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError):
        complete(client, model="gpt-5", prompt=[1])


def test_batch_over_limit(client):
    with pytest.raises(openai.BadRequestError):
        complete(client, prompt=[[1]] * 20, n=64)


def generated_tokens(daemon):
    for line in daemon.get("/metrics").text.splitlines():
        if line.startswith("rolloutd_generation_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("rolloutd_generation_tokens_total missing from /metrics")


def test_abort_by_request_id(client, daemon):
    import threading
    import time
    box = {}
    before = generated_tokens(daemon)
    t = threading.Thread(target=lambda: box.setdefault("r", complete(
        client, prompt=PROMPT, max_tokens=3000, extra_body={"ignore_eos": True, "request_id": "oa-1"})))
    t.start()
    deadline = time.time() + 30  # abort once the request is generating, so partial tokens exist
    while generated_tokens(daemon) < before + 5 and time.time() < deadline:
        time.sleep(0.01)
    deadline = time.time() + 10
    while time.time() < deadline:
        r = daemon.post("/abort_request", {"rid": "oa-1"})
        if r.json()["aborted"] == 1:
            break
        time.sleep(0.02)
    t.join(timeout=60)
    res = box["r"]
    assert res.id == "cmpl-oa-1"
    assert res.choices[0].finish_reason == "abort"
    assert 0 < len(res.choices[0].token_ids) < 3000


def test_api_key(rolloutd):
    d = rolloutd(None, "--kv-cache-mb", "64", "--api-key", "sekrit")
    bad = openai.OpenAI(base_url=d.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="default", prompt=[1], max_tokens=1)
    good = openai.OpenAI(base_url=d.url + "/v1", api_key="sekrit", max_retries=0)
    assert len(good.completions.create(model="default", prompt=[1], max_tokens=2,
                                       extra_body={"ignore_eos": True}).choices[0].token_ids) == 2
    assert requests.get(d.url + "/metrics", timeout=10).status_code == 200  # open, like /health
