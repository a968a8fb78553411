"""Text in, text out through the HTTP API, checked against Hugging Face `tokenizers` reading the same
tokenizer.json (the embedded default model's) and against the official `openai` client.

- text prompts give the same output ids as the equivalent input_ids (tokenizers' encode);
- every output's text is tokenizers' decode of its ids;
- stop strings, including ones that span tokens, end the output on the token that completes them,
  exactly where decoding the output after every token (the naive reference) first contains one;
  the text is cut before the match (or after it with no_stop_trim); ids and logprobs keep every
  token; stop tokens are cut from the text unless no_stop_trim;
- stop regexes (SGLang's stop_regex) end the output on the first token after which Python's `re.search`
  finds a match in the re-decoded output, cut like stop strings, with the pattern as `matched`;
- SSE text deltas concatenate to the final text, for /v1/completions and for /generate (cumulative
  events and --incremental-streaming-output);
- logprob token texts, /tokenize, /detokenize and the model info.
"""
import json
import pathlib
import re

import openai
import pytest
import requests

from conftest import Daemon

tokenizers = pytest.importorskip("tokenizers", reason="Hugging Face tokenizers is the reference here")

PROMPTS = ["Hello, world! The answer is", "def f(x):\n    return x * 2", "你好，世界 🙂 ok", "  spaces\tand\nnewlines"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(None, ["--kv-cache-mb", "128"], tmp_path_factory.mktemp("text") / "rolloutd.log")
    yield d
    rc = d.stop()
    assert rc == 0, f"rolloutd exited with {rc}:\n{d.read_log()[-4000:]}"


@pytest.fixture(scope="module")
def tok(daemon):
    info = daemon.get("/get_model_info").json()
    return tokenizers.Tokenizer.from_file(info["tokenizer_path"])


def generate(d, **body):
    r = d.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def sp(**kw):
    base = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}
    base.update(kw)
    return base


def sse_events(resp):
    events = []
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith(b"data: "), line
        data = line[6:]
        if data == b"[DONE]":
            events.append(None)
        else:
            events.append(json.loads(data))
    assert events and events[-1] is None, "stream must end with [DONE]"
    return events[:-1]


def naive_stop(tok, ids, stops, keep_special=False):
    """(k, stop, pos): the first k at which decode(ids[:k]) contains a stop string, the first stop
    string of the list that it contains, and where that string first occurs in the answer's text
    (special tokens skipped); None when no stop string occurs. SGLang's check_finished and
    detokenizer trim: /generate searches the ids decoded with special tokens kept
    (keep_special=True); vLLM (/v1/completions) searches the answer's text."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=not keep_special)
        hit = next((s for s in stops if s in text), None)
        if hit is not None:
            return k, hit, tok.decode(ids[:k], skip_special_tokens=True).find(hit)
    return None


def spanning_stop(tok, ids, start=6):
    """A stop string of the output that only a token boundary crossing completes: the last
    character of decode(ids[:k]) plus the first of the next token's text, first occurring there."""
    for k in range(start, len(ids) - 1):
        left = tok.decode(ids[:k], skip_special_tokens=True)
        right = tok.decode(ids[:k + 1], skip_special_tokens=True)
        if not left or len(right) <= len(left) or not right.startswith(left):
            continue
        s = left[-2:] + right[len(left):len(left) + 2]
        if "\ufffd" in s or s.strip() == "" or s in left:
            continue
        if all(s not in tok.decode([i]) for i in ids[:k + 2]):
            return s
    pytest.fail("no stop string spanning a token boundary in the output")


def test_text_prompts_match_input_ids(daemon, tok):
    for p in PROMPTS:
        ids = tok.encode(p).ids
        a = generate(daemon, text=p, sampling_params=sp())
        b = generate(daemon, input_ids=ids, sampling_params=sp())
        assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 24
        assert a["meta_info"]["prompt_tokens"] == len(ids)
        assert a["text"] == b["text"] == tok.decode(a["output_ids"], skip_special_tokens=True)
    batch = generate(daemon, text=PROMPTS[:3], sampling_params=sp(max_new_tokens=6, n=2))
    assert isinstance(batch, list) and len(batch) == 6
    for i, o in enumerate(batch):
        alone = generate(daemon, input_ids=tok.encode(PROMPTS[i // 2]).ids, sampling_params=sp(max_new_tokens=6, n=2))
        assert o["output_ids"] == alone[i % 2]["output_ids"]
        assert o["text"] == tok.decode(o["output_ids"], skip_special_tokens=True)


def test_stop_strings_span_tokens_and_trim(daemon, tok):
    full = generate(daemon, text=PROMPTS[0], sampling_params=sp(max_new_tokens=48), return_logprob=True)
    ids = full["output_ids"]
    stop = spanning_stop(tok, ids)
    k, s, pos = naive_stop(tok, ids, [stop, "\u2713never"], keep_special=True)
    assert s == stop
    for trim in (False, True):
        o = generate(daemon, text=PROMPTS[0], sampling_params=sp(max_new_tokens=48, stop=["\u2713never", stop],
                                                               no_stop_trim=trim), return_logprob=True)
        assert o["output_ids"] == ids[:k]  # the token that completed the match is kept
        assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert o["meta_info"]["completion_tokens"] == k
        assert [t[1] for t in o["meta_info"]["output_token_logprobs"]] == ids[:k]
        assert [t[0] for t in o["meta_info"]["output_token_logprobs"]] == \
            [t[0] for t in full["meta_info"]["output_token_logprobs"][:k]]
        text = tok.decode(ids[:k], skip_special_tokens=True)
        assert o["text"] == (text[:pos + len(stop)] if trim else text[:pos])
    # a single string (not a list) works the same
    o = generate(daemon, text=PROMPTS[0], sampling_params=sp(max_new_tokens=48, stop=stop))
    assert o["output_ids"] == ids[:k]


def test_stop_strings_as_sglang_checks_them(daemon, tok):
    """/generate searches stop strings in the output decoded with special tokens kept, as SGLang's
    check_finished (tokenizer.decode's default): a special token's own text stops an output with
    skip_special_tokens on, and is not in its text. Of two stop strings that the same token
    completes, the first of the request's list wins."""
    special = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
    special_ids = {tok.token_to_id(t) for t in special}
    base = dict(max_new_tokens=120, temperature=1.0, ignore_eos=True)
    for seed in range(1, 200):  # an output that samples a special token
        full = generate(daemon, input_ids=[1, 100, 200, 300], sampling_params=dict(base, sampling_seed=seed))
        ids = full["output_ids"]
        first = next((i for i, t in enumerate(ids) if t in special_ids), None)
        if first is not None and 0 < first < len(ids) - 1:  # the last token finishes "length" (SGLang's)
            break
    else:
        pytest.fail("no output with a special token")
    stop = tok.id_to_token(ids[first])
    k, s, pos = naive_stop(tok, ids, [stop], keep_special=True)
    assert (k, s) == (first + 1, stop)
    for skip in (True, False):
        o = generate(daemon, input_ids=[1, 100, 200, 300],
                     sampling_params=dict(base, sampling_seed=seed, stop=[stop], skip_special_tokens=skip))
        assert o["output_ids"] == ids[:k] and o["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        text = tok.decode(ids[:k], skip_special_tokens=skip)
        assert o["text"] == (text if skip else text[:text.find(stop)])
    # list order: two stop strings completed by the same token (its text's last two characters)
    text = tok.decode(ids, skip_special_tokens=True)
    for k in range(2, len(ids)):
        prev, cur = tok.decode(ids[:k - 1], skip_special_tokens=False), tok.decode(ids[:k], skip_special_tokens=False)
        piece = cur[len(prev):] if cur.startswith(prev) else ""
        if len(piece) >= 2 and "\ufffd" not in piece and piece[-2] not in prev and piece[-1] not in prev \
                and piece[-2] != piece[-1] and ids[k - 1] not in special_ids:
            break
    else:
        pytest.fail("no token with two new characters")
    a, b = piece[-1], piece[-2]  # b occurs first in the text; a is first in the list
    o = generate(daemon, input_ids=[1, 100, 200, 300], sampling_params=dict(base, sampling_seed=seed, stop=[a, b]))
    assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": a}
    assert len(o["output_ids"]) == k
    assert o["text"] == tok.decode(ids[:k], skip_special_tokens=True).split(a)[0]


def naive_regex(tok, ids, pattern):
    """(k, match): the first k at which re.search(pattern, decode(ids[:k])) finds a match, or None."""
    for k in range(1, len(ids) + 1):
        m = re.search(pattern, tok.decode(ids[:k], skip_special_tokens=True))
        if m:
            return k, m
    return None


def test_stop_regex_matches_python_re(daemon, tok):
    full = generate(daemon, text=PROMPTS[0], sampling_params=sp(max_new_tokens=48))
    ids = full["output_ids"]
    text = tok.decode(ids, skip_special_tokens=True)
    lit = spanning_stop(tok, ids)
    # patterns whose first match the output's own text decides: a spanning literal with a wildcard
    # in it, unbounded and bounded repeats, a lookbehind, an alternation, one that never matches
    patterns = [re.escape(lit[:1]) + "." + re.escape(lit[2:]), r"\S{4,}\s", r"(?<=\s)\w{2}", r"[aeiou]{2}|[0-9]",
                "\u2713never"]
    matched = 0
    for pat in patterns:
        ref = naive_regex(tok, ids, pat)
        for trim in (False, True):
            o = generate(daemon, text=PROMPTS[0], return_logprob=True,
                         sampling_params=sp(max_new_tokens=48, stop_regex=[pat], no_stop_trim=trim))
            if ref is None:
                assert o["output_ids"] == ids and o["meta_info"]["finish_reason"]["type"] == "length"
                assert o["text"] == text
                continue
            k, m = ref
            assert o["output_ids"] == ids[:k], pat  # the token that completed the match is kept
            assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": pat}
            assert len(o["meta_info"]["output_token_logprobs"]) == k
            assert o["text"] == (m.string[:m.end()] if trim else m.string[:m.start()]), pat
        matched += ref is not None
    assert matched >= 3, "the patterns must exercise matches"
    # a stop string and a regex: whichever completes first ends the output
    ref = naive_regex(tok, ids, patterns[1])
    o = generate(daemon, text=PROMPTS[0], sampling_params=sp(max_new_tokens=48, stop=lit, stop_regex=patterns[1]))
    k_str = naive_stop(tok, ids, [lit], keep_special=True)[0]
    assert len(o["output_ids"]) == min(k_str, ref[0])
    # streaming never shows text a later match cuts away
    body = {"text": PROMPTS[0], "sampling_params": sp(max_new_tokens=48, stop_regex=patterns[1]), "stream": True}
    with requests.post(daemon.url + "/generate", json=body, stream=True, timeout=120) as r:
        texts = [e["text"] for e in sse_events(r)]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == ref[1].string[:ref[1].start()]
    # the OpenAI route takes SGLang's stop_regex too; stop_reason names the pattern
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none")
    c = client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=48, temperature=1.0, seed=11,
                                  extra_body={"ignore_eos": True, "stop_regex": patterns[1]})
    assert c.choices[0].finish_reason == "stop" and c.choices[0].model_extra["stop_reason"] == patterns[1]
    # a pattern that does not compile is a 400 naming it
    r = daemon.post("/generate", {"text": "x", "sampling_params": {"stop_regex": ["ok", "a(b"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.stop_regex[1]", r.text
    assert "not a valid regular expression" in r.json()["error"]["message"]


def test_stop_token_is_cut_from_the_text_unless_no_stop_trim(daemon, tok):
    full = generate(daemon, text=PROMPTS[1], sampling_params=sp(max_new_tokens=20, ignore_eos=False))
    ids = full["output_ids"]
    stop_id = ids[7]
    first = ids.index(stop_id)
    for trim in (False, True):  # ignore_eos off: on /generate it turns stop_token_ids off too (SGLang's)
        o = generate(daemon, text=PROMPTS[1], sampling_params=sp(max_new_tokens=20, stop_token_ids=[stop_id],
                                                               no_stop_trim=trim, skip_special_tokens=False,
                                                               ignore_eos=False))
        assert o["output_ids"] == ids[:first + 1]
        assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
        assert o["text"] == tok.decode(ids[:first + 1] if trim else ids[:first], skip_special_tokens=False)


def test_return_text_in_logprobs(daemon, tok):
    o = generate(daemon, text=PROMPTS[2], sampling_params=sp(max_new_tokens=8), return_logprob=True,
                 return_text_in_logprobs=True, top_logprobs_num=3, logprob_start_len=0)
    m = o["meta_info"]
    for lp, i, text in m["output_token_logprobs"]:
        assert text == tok.decode([i], skip_special_tokens=False)
    for lp, i, text in m["input_token_logprobs"]:
        assert text == tok.decode([i], skip_special_tokens=False)
    for pos in m["output_top_logprobs"]:
        assert len(pos) == 3 and all(t == tok.decode([i], skip_special_tokens=False) for _, i, t in pos)


def test_generate_stream_text(daemon, tok, rolloutd):
    full = generate(daemon, text=PROMPTS[2], sampling_params=sp(max_new_tokens=40))
    stop = spanning_stop(tok, full["output_ids"])
    body = {"text": PROMPTS[2], "sampling_params": sp(max_new_tokens=40, stop=stop), "stream": True}
    final = generate(daemon, **dict(body, stream=False))
    assert final["meta_info"]["finish_reason"]["matched"] == stop
    with requests.post(daemon.url + "/generate", json=body, stream=True, timeout=120) as r:
        events = sse_events(r)
    texts = [e["text"] for e in events]
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a)  # cumulative events only grow: nothing shown is taken back
    assert texts[-1] == final["text"] and events[-1]["output_ids"] == final["output_ids"]
    # incremental events: the deltas concatenate to the final text
    d = rolloutd(None, "--kv-cache-mb", "64", "--incremental-streaming-output", "true")
    with requests.post(d.url + "/generate", json=body, stream=True, timeout=120) as r:
        events = sse_events(r)
    assert "".join(e["text"] for e in events) == final["text"]
    assert sum((e["output_ids"] for e in events), []) == final["output_ids"]


def test_completions_stream_deltas_concatenate(daemon, tok):
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=120)
    kw = dict(model="default", prompt=PROMPTS[3], max_tokens=40, temperature=1.0, seed=4,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    ids = whole.choices[0].model_extra["token_ids"]
    assert whole.choices[0].text == tok.decode(ids, skip_special_tokens=True)
    stop = spanning_stop(tok, ids)
    k, _, pos = naive_stop(tok, ids, [stop])
    want = tok.decode(ids[:k], skip_special_tokens=True)[:pos]
    stopped = client.completions.create(**kw, stop=[stop])
    c = stopped.choices[0]
    assert c.text == want and c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop
    assert c.model_extra["token_ids"] == ids[:k]
    deltas, n_chunks = [], 0
    for chunk in client.completions.create(**kw, stop=stop, stream=True):
        n_chunks += 1
        for ch in chunk.choices:
            deltas.append(ch.text)
    assert n_chunks > 2 and "".join(deltas) == want
    for delta in deltas:
        delta.encode("utf-8")  # every delta is whole characters (a cut one would not decode as JSON text)


def test_openai_client_string_prompts(daemon, tok):
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = client.completions.create(model="default", prompt=PROMPTS[:2], max_tokens=6, temperature=0.0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 2
    for i, c in enumerate(r.choices):
        ids = c.model_extra["token_ids"]
        alone = client.completions.create(model="default", prompt=tok.encode(PROMPTS[i]).ids, max_tokens=6,
                                          temperature=0.0, extra_body={"ignore_eos": True})
        assert ids == alone.choices[0].model_extra["token_ids"]
        assert c.text == tok.decode(ids, skip_special_tokens=True)
        assert c.logprobs.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
        assert len(c.logprobs.top_logprobs) == 6
    assert r.usage.prompt_tokens == sum(len(tok.encode(p).ids) for p in PROMPTS[:2])
    as_ids = client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=4, temperature=0.0, logprobs=0,
                                       extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    c = as_ids.choices[0]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in c.model_extra["token_ids"]]
    echo = client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=4, temperature=0.0, echo=True,
                                     extra_body={"ignore_eos": True})
    out = tok.decode(echo.choices[0].model_extra["token_ids"], skip_special_tokens=True)
    assert echo.choices[0].text == PROMPTS[0] + out
    # echo gives the prompt as sent (vLLM's), even where its tokens decode to other text: the
    # tokenizer normalizes to NFC, so "e" + U+0301 comes back from the tokens as U+00E9
    odd = "e\u0301 \u00e9 ok"
    assert tok.decode(tok.encode(odd).ids) != odd
    echo = client.completions.create(model="default", prompt=[odd, PROMPTS[1]], max_tokens=2, temperature=0.0,
                                     echo=True, extra_body={"ignore_eos": True})
    for c, p in zip(echo.choices, [odd, PROMPTS[1]]):
        assert c.text == p + tok.decode(c.model_extra["token_ids"], skip_special_tokens=True)


def test_tokenize_and_detokenize(daemon, tok):
    p = PROMPTS[2]
    r = daemon.post("/tokenize", {"prompt": p, "return_token_strs": True}).json()
    enc = tok.encode(p)
    assert r == {"tokens": enc.ids, "count": len(enc.ids), "token_strs": enc.tokens, "max_model_len": 4096}
    r = daemon.post("/tokenize", {"prompt": PROMPTS[:2], "model": "default"}).json()
    assert r["tokens"] == [tok.encode(x).ids for x in PROMPTS[:2]] and r["count"] == [len(x) for x in r["tokens"]]
    ids = enc.ids + [2, 1]  # special tokens too
    r = daemon.post("/detokenize", {"tokens": ids}).json()
    assert r["text"] == r["prompt"] == tok.decode(ids, skip_special_tokens=False)
    r = daemon.post("/detokenize", {"tokens": [ids, [5]], "skip_special_tokens": True}).json()
    assert r["text"] == [tok.decode(ids, skip_special_tokens=True), tok.decode([5])]
    bad = daemon.post("/detokenize", {"tokens": [1, 9000]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    bad = daemon.post("/tokenize", {"prompt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


def test_invalid_utf8_names_the_field(daemon):
    for path, body, param in [("/generate", b'{"text": ["ok", "b\xff"]}', "text[1]"),
                              ("/generate", b'{"input_ids": [1], "sampling_params": {"stop": "\xc3("}}',
                               "sampling_params.stop"),
                              ("/v1/completions", b'{"prompt": "\xe4\xb8", "max_tokens": 1}', "prompt"),
                              ("/tokenize", b'{"prompt": "a\x80"}', "prompt")]:
        r = daemon.post(path, body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "not valid UTF-8" in err["message"], err
    assert daemon.get("/health").status_code == 200


def test_model_info_names_the_tokenizer(daemon):
    info = daemon.get("/model_info").json()
    assert pathlib.Path(info["tokenizer_path"]).name == "tokenizer.json"
    assert pathlib.Path(info["tokenizer_path"]).parent == pathlib.Path(info["model_path"])
    assert info["bos_token_id"] == 1 and info["eos_token_id"] == 2 and info["eos_token_ids"] == [2]
