"""GET /openapi.json: the OpenAPI 3.1 description that the daemon makes from its route table and from
the descriptor tables its parsers read request bodies with, checked with tools others wrote.

- openapi-spec-validator (PyPI) validates the document against the OpenAPI 3.1 specification.
- Every path it lists answers (not 404) to the methods it lists, the Allow header of a 405 agrees,
  and the API key guards it as it says.
- jsonschema (PyPI) checks what every route answers, plain, batched, n > 1, streamed (each
  Server-Sent Event) and with every kind of logprob, against the schema the document gives its 200.
- schemathesis (PyPI), a property-based API tester, generates thousands of requests from the
  document, with a fixed seed: bodies that conform to it, and, from every constraint it states,
  bodies that break one. It checks that no request gets a 5xx, that every status and content type
  is one the document lists, that every answer conforms to the document's schema (every error has
  the one error shape), and that every body that breaks the schema gets a 4xx: that the parser
  refuses what the document says it refuses. The document states the daemon's own limits (token
  ids below its vocabulary, max_new_tokens up to --max-new-tokens, n, top logprobs), but a
  conforming body may still be a 400 for what a schema cannot say (prompt + max_new_tokens past the
  context, min_new_tokens above max_new_tokens), so acceptance is not checked.
  /pause_generation is left out: a pause holds every later generation until /continue_generation
  (test_ops.py drives the two), and so is PUT /generate, POST /generate under another method.

The tools are installed into a throwaway venv under build/ (conftest.tool_venv); where that
cannot be done, the tests that need them skip, saying why.
"""
import json
import os
import subprocess

import requests

from conftest import tool_venv

TOOLS_SPEC = "schemathesis==4.32.5 openapi-spec-validator==0.9.0"
# Small limits, so that the generation requests schemathesis makes are cheap (a body without
# max_new_tokens gets the default lowered to 4 here), and a short rendezvous timeout for
# /init_weights_update_group's generated addresses. ROLLOUTD_SCHEMATHESIS_DEEP=1 runs it with 50
# examples an operation against a daemon that generates up to the default 128 tokens, so that
# longer answers are checked too (minutes on 2 cores, against seconds).
DEEP = os.environ.get("ROLLOUTD_SCHEMATHESIS_DEEP") == "1"
DAEMON_ARGS = ["--max-new-tokens", "128" if DEEP else "4", "--max-n", "4", "--max-batch", "8",
               "--max-context", "192" if DEEP else "256", "--weight-update-timeout", "2"]
EXAMPLES = "50" if DEEP else "20"


def tools_python():
    return tool_venv("openapi-venv", TOOLS_SPEC, "import schemathesis, openapi_spec_validator")


def document(d, **kw):
    r = d.get("/openapi.json", **kw)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    return r.json()


def test_document_lists_the_routes_and_their_bodies(rolloutd, tmp_path):
    d = rolloutd(None)
    doc = document(d)
    assert doc["openapi"] == "3.1.0"
    paths = doc["paths"]
    # the routes docs/api.md documents (an independent list), each with its methods
    for path, methods in {"/generate": {"post", "put"}, "/v1/completions": {"post"}, "/health": {"get"},
                          "/metrics": {"get"}, "/flush_cache": {"get", "post"}, "/update_weights_from_shm": {"post"},
                          "/init_weights_update_group": {"post"}, "/abort_request": {"post"},
                          "/tokenize": {"post"}, "/get_model_info": {"get"}, "/openapi.json": {"get"}}.items():
        assert set(paths[path]) == methods, (path, set(paths[path]))
    gen = paths["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert gen["additionalProperties"] is False
    sp = gen["properties"]["sampling_params"]["anyOf"][0]["properties"]
    # (0, 1] as the fp32 it is stored in has it: 2**-150 and below round to 0
    assert sp["top_p"]["anyOf"][0] == {"type": "number", "exclusiveMinimum": 2**-150, "maximum": 1}
    assert sp["top_k"]["anyOf"][0]["not"] == {"const": 0}
    # a field rolloutd does not implement: null and its neutral values only
    assert gen["properties"]["image_data"]["enum"] == [None, []]
    assert paths["/update_weights_from_shm"]["post"]["requestBody"]["content"]["application/json"]["schema"][
        "required"] == ["shm_name", "tensors"]
    # the daemon's own limits, as /get_server_info and /get_model_info report them, are the maxima
    si, vocab = d.get("/get_server_info").json(), d.get("/get_model_info").json()["vocab_size"]
    new_max = min(si["max_new_tokens"], si["max_context_len"] - 1)
    cmpl = paths["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    for schema, want in [(sp["max_new_tokens"], new_max), (sp["min_new_tokens"], new_max), (sp["n"], si["max_n"]),
                         (cmpl["max_tokens"], new_max), (cmpl["n"], si["max_n"]),
                         (cmpl["logprobs"], si["max_top_logprobs"]),
                         ({"anyOf": [sp["stop_token_ids"]["anyOf"][0]["items"]]}, vocab - 1),
                         ({"anyOf": [gen["properties"]["input_ids"]["anyOf"][0]["anyOf"][0]["items"]]}, vocab - 1)]:
        assert schema["anyOf"][0]["maximum"] == want, (schema, want)
    # and they are where the daemon draws the line: the maximum is served, one past it is a 400
    at = {"input_ids": [vocab - 1], "top_logprobs_num": si["max_top_logprobs"], "return_logprob": True,
          "sampling_params": {"max_new_tokens": 1, "n": si["max_n"], "stop_token_ids": [vocab - 1]}}
    assert d.post("/generate", at).status_code == 200
    for past, param in [({"input_ids": [vocab]}, "input_ids"),
                        ({"top_logprobs_num": si["max_top_logprobs"] + 1}, "top_logprobs_num"),
                        ({"sampling_params": dict(at["sampling_params"], n=si["max_n"] + 1)}, "sampling_params.n"),
                        # past the context: the 400 names the prompt that does not fit
                        ({"sampling_params": {"max_new_tokens": new_max + 1}},
                         "sampling_params.max_new_tokens" if new_max == si["max_new_tokens"] else "input_ids")]:
        r = d.post("/generate", dict(at, **past))
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), (past, r.text)
    # every path answers its methods (a 4xx for a missing or bad body at most), and nothing else
    for path, item in paths.items():
        if path == "/pause_generation":
            continue
        for method in item:
            r = requests.request(method.upper(), d.url + path, timeout=60)
            assert r.status_code not in (404, 405) and r.status_code < 500, (method, path, r.status_code, r.text)
        if "delete" not in item:
            r = requests.delete(d.url + path, timeout=60)
            assert r.status_code == 405, (path, r.status_code)
            allow = {m.strip().lower() for m in r.headers["Allow"].split(",")}
            assert allow - {"head"} == set(item) and ("head" in allow) == ("get" in item), (path, r.headers)
    assert d.get("/no_such_route").status_code == 404
    # openapi-spec-validator: a valid OpenAPI 3.1 document
    python = tools_python()
    (tmp_path / "doc.json").write_text(json.dumps(doc))
    out = subprocess.run([str(python), "-c", "import json, sys; from openapi_spec_validator import validate; "
                          "validate(json.load(open(sys.argv[1]))); print('valid')", str(tmp_path / "doc.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "valid" in out.stdout, out.stdout + out.stderr


# Validates each (path, method, answer) of a JSON file against the document's 200 schema for it.
VALIDATE = """
import json, sys
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
doc, cases = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
bad = []
for path, method, answer in cases:
    content = doc["paths"][path][method]["responses"]["200"]["content"]
    schema = dict(content["application/json"]["schema"], components=doc["components"])
    e = best_match(Draft202012Validator(schema).iter_errors(answer))
    if e is not None:
        bad.append(f"{method} {path}: {e.message[:300]} at {list(e.absolute_path)}")
print("\\n".join(bad) or f"{len(cases)} answers valid")
sys.exit(1 if bad else 0)
"""


def sse_events(r):
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: {")]


def test_answers_match_the_document(rolloutd, tmp_path):
    """What the routes answer, in every optional part a client may ask for, against the schemas the
    document declares for their 200s (jsonschema, Draft 2020-12): a change to a writer in protocol/
    that a document reader would trip over fails here."""
    d = rolloutd(None)
    doc = document(d)
    cases = []

    def post(path, body, method="post"):
        r = requests.request(method.upper(), d.url + path, json=body, timeout=120, stream=bool(body.get("stream")))
        assert r.status_code == 200, (path, body, r.text)
        if body.get("stream"):
            events = sse_events(r)
            assert events, path
            cases.extend([path, method, e] for e in events)
        else:
            cases.append([path, method, r.json()])

    sp = {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 1}
    post("/generate", {"input_ids": [1, 2, 3], "sampling_params": sp})
    post("/generate", {"input_ids": [1, 2, 3], "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0,
                       "sampling_params": sp})
    post("/generate", {"text": "a b", "return_logprob": True, "return_text_in_logprobs": True, "top_logprobs_num": 2,
                       "logprob_start_len": 1, "sampling_params": dict(sp, n=2)})
    post("/generate", {"input_ids": [[1, 2], [3]], "rid": ["x1", "x2"], "sampling_params": dict(sp, stop="e")})
    post("/generate", {"input_ids": [1, 2], "stream": True, "return_logprob": True, "sampling_params": sp})
    post("/generate", {"input_ids": [1, 2], "sampling_params": sp}, method="put")
    post("/v1/completions", {"prompt": "a b", "max_tokens": 4, "seed": 1})
    post("/v1/completions", {"prompt": [[1, 2], [3]], "max_tokens": 3, "logprobs": 2, "n": 2, "echo": True,
                             "return_token_ids": True, "seed": 2})
    post("/v1/completions", {"prompt": "a", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}})
    post("/tokenize", {"prompt": "a b"})
    post("/tokenize", {"prompt": ["a", "b c"], "return_token_strs": True})
    post("/detokenize", {"tokens": [5, 6]})
    post("/detokenize", {"tokens": [[5], [6, 7]]})
    post("/abort_request", {"rid": "nothing-by-this-name"})
    post("/abort_request", {"abort_all": True})
    post("/pause_generation", {"mode": "abort"})
    post("/continue_generation", {})
    post("/flush_cache", {})
    post("/update_weight_version", {"new_version": "7"})
    for path in ("/health", "/health_generate", "/get_model_info", "/model_info", "/get_server_info", "/server_info",
                 "/get_load", "/v1/loads", "/get_weight_version", "/v1/models", "/flush_cache", "/openapi.json"):
        r = d.get(path)
        assert r.status_code == 200, (path, r.text)
        cases.append([path, "get", r.json()])
    r = d.get("/metrics")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    (tmp_path / "doc.json").write_text(json.dumps(doc))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = subprocess.run([str(tools_python()), "-c", VALIDATE, str(tmp_path / "doc.json"), str(tmp_path / "cases.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_api_key_guards_the_document(rolloutd):
    d = rolloutd(None, "--api-key", "k3y")
    r = d.get("/openapi.json")
    assert r.status_code == 401 and r.json()["error"]["type"] == "unauthorized", r.text
    doc = document(d, headers={"Authorization": "Bearer k3y"})
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert doc["security"] == [{"bearer": []}]
    # the routes open without the key say so
    assert doc["paths"]["/health"]["get"]["security"] == [] == doc["paths"]["/metrics"]["get"]["security"]
    assert "security" not in doc["paths"]["/generate"]["post"]
    assert "securitySchemes" not in document(rolloutd(None))["components"]


def test_schemathesis_finds_nothing(rolloutd, tmp_path):
    python = tools_python()
    d = rolloutd(None, *DAEMON_ARGS)
    cmd = [str(python), "-m", "schemathesis.cli", "run", d.url + "/openapi.json", "--checks", "all",
           "--exclude-checks", "positive_data_acceptance", "--max-examples", EXAMPLES, "--seed", "1",
           "--phases", "examples,coverage,fuzzing", "--exclude-path", "/pause_generation",
           # PUT /generate is POST /generate under SGLang's other method (one handler, one table): its
           # coverage phase, the longest of any operation, would run twice
           "--exclude-name", "PUT /generate",
           "--request-timeout", "30", "--generation-database", "none",
           # hypothesis' health checks time the data generation: on a loaded machine they fail a run
           # that found nothing
           "--suppress-health-check", "all"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=2400 if DEEP else 900, cwd=tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-8000:]
    assert " passed" in log and "failed" not in log.split("SUMMARY")[-1], log[-8000:]
    # and the daemon still serves
    assert d.get("/health").status_code == 200
    r = d.post("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2, r.text
