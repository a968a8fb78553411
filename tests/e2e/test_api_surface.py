"""The whole SGLang / vLLM request surface: every field either engine defines for a route is known.

The field lists below are copied from the engines' own sources (not from rolloutd's tables):
  SGLang  python/sglang/srt/managers/io_struct.py at 001067ff (GenerateReqInput, the weight-update
          structs, AbortReq, ...), python/sglang/srt/sampling/sampling_params.py at 00c17caf
          (SamplingParams), sgl-router's GenerateRequest (model, data_parallel_rank_decode);
          python/sglang/srt/entrypoints/openai/protocol.py at 004c82e0 (CompletionRequest);
  vLLM    vllm/entrypoints/openai/completion/protocol.py at d5dba2d7 (CompletionRequest), plus
          OpenAI's best_of.
Each field sent as null (SGLang's and pydantic's "absent") must be accepted; the request shapes
real clients send (sglang-router's re-serialization, AReaL, slime) must be served; and
docs/api-fields.md must be what build/print-fields prints from the parsers' tables today.
"""
import json
import os
import pathlib
import subprocess

import pytest

from conftest import BIN, ROOT, Daemon

GENERATE_FIELDS = [
    "rid", "session_id", "text", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
    "mm_content_hashes", "use_audio_in_video", "video_config", "sampling_params", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_sampling_mask", "return_text_in_logprobs",
    "return_flat_raw_top_logprobs", "return_flat_raw_top_logprobs_b64", "stream", "log_metrics",
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len", "return_indexer_topk", "modalities",
    "session_params", "lora_path", "lora_id", "custom_logit_processor", "positional_embed_overrides",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank",
    "data_parallel_rank", "disagg_prefill_dp_rank", "kv_router_hint", "routing_key", "conversation_id",
    "http_worker_ipc", "background", "require_reasoning", "max_thinking_tokens", "priority", "extra_key", "no_logs",
    "custom_labels", "return_bytes", "return_entropy", "return_prompt_token_ids", "external_trace_header",
    "received_time", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls", "max_dynamic_patch",
    "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "multi_item_delimiter_indices", "cache_salt",
    "model", "data_parallel_rank_decode",  # sglang-router's GenerateRequest
]
SAMPLING_FIELDS = [
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "custom_params", "stream_interval", "logit_bias", "sampling_seed",
]
COMPLETION_FIELDS = [
    "model", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty", "seed",
    "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user", "use_beam_search", "top_k",
    "min_p", "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "allowed_token_ids", "prompt_logprobs", "prompt_embeds", "add_special_tokens", "response_format",
    "structured_outputs", "priority", "request_id", "logits_processors", "return_tokens_as_token_ids",
    "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs", "max_repetition_pattern_size",
    "min_repetition_pattern_size", "repetition_min_count",
    "best_of",  # OpenAI's
    # SGLang's CompletionRequest, beyond vLLM's
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len", "return_cached_tokens_details",
    "json_schema", "regex", "ebnf", "stop_regex", "no_stop_trim", "lora_path", "session_id", "session_params",
    "custom_params", "custom_logit_processor", "images_config", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank", "rid", "extra_key", "ngram_corpus_id",
    "custom_labels",
]
BASE_REQ = ["rid", "http_worker_ipc"]
WEIGHT_ROUTES = {  # route -> (a body that parses, the struct's fields)
    "/update_weights_from_disk": ({"model_path": "/nonexistent/ckpt"},
                                  ["load_format", "abort_all_requests", "weight_version", "is_async",
                                   "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step",
                                   "flush_cache", "manifest"]),
    "/update_weights_from_distributed": ({"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[1]]},
                                         ["group_name", "flush_cache", "abort_all_requests", "weight_version",
                                          "load_format", "torch_empty_cache"]),
    "/init_weights_update_group": ({"master_address": "127.0.0.1", "master_port": 29711, "rank_offset": 1,
                                    "world_size": 2}, ["group_name", "backend"]),
    "/destroy_weights_update_group": ({}, ["group_name"]),
    "/update_weight_version": ({"new_version": "7"}, ["abort_all_requests"]),
}
CONTROL_ROUTES = {"/abort_request": ({"rid": "nobody"}, ["abort_all", "finished_reason", "abort_message",
                                                         "weight_versions"]),
                  "/pause_generation": ({"mode": "in_place"}, ["mode"]),
                  "/continue_generation": ({}, ["torch_empty_cache"]),
                  "/flush_cache": ({}, ["timeout_s"])}

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0, "temperature": 0}}  # parsed, not run
CMPL = {"model": "default", "prompt": [1, 2, 3], "max_tokens": 0, "temperature": 0}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    # --max-new-tokens 4: a null max_tokens (as many as the context allows) stays short
    d = Daemon(None, ["--kv-cache-mb", "64", "--max-new-tokens", "4"], tmp_path_factory.mktemp("surface") / "rolloutd.log")
    yield d
    rc = d.stop()
    assert rc == 0, f"rolloutd exited with {rc}:\n{d.read_log()[-4000:]}"


def not_unknown(r, field):
    """The request got past the parser's field check: no 400 naming `field` as unknown."""
    if r.status_code == 200:
        return
    err = r.json()["error"]
    assert "unknown field" not in err["message"], (field, err)


# null = the default: for sampling_params and max_new_tokens SGLang's 128, lowered to this daemon's cap
def accepted(r, field):
    assert r.status_code == 200, (field, r.text)
    if field in ("sampling_params", "max_new_tokens"):
        assert len(r.json()["output_ids"]) == 4, r.text


@pytest.mark.parametrize("field", GENERATE_FIELDS)
def test_generate_field_null_is_accepted(daemon, field):
    accepted(daemon.post("/generate", dict(GEN, **{field: None})), field)


@pytest.mark.parametrize("field", SAMPLING_FIELDS)
def test_sampling_field_null_is_accepted(daemon, field):
    accepted(daemon.post("/generate", dict(GEN, sampling_params=dict(GEN["sampling_params"], **{field: None}))), field)


@pytest.mark.parametrize("field", COMPLETION_FIELDS)
def test_completion_field_null_is_accepted(daemon, field):
    r = daemon.post("/v1/completions", dict(CMPL, **{field: None}))
    assert r.status_code == 200, (field, r.text)


@pytest.mark.parametrize("route,field", [(r, f) for r, (_, fs) in WEIGHT_ROUTES.items() for f in fs + BASE_REQ] +
                         [(r, f) for r, (_, fs) in CONTROL_ROUTES.items() for f in fs + BASE_REQ])
def test_control_field_null_is_known(daemon, route, field):
    body = dict((WEIGHT_ROUTES.get(route) or CONTROL_ROUTES[route])[0], **{field: None})
    not_unknown(daemon.post(route, body), field)
    if route == "/pause_generation":
        assert daemon.post("/continue_generation", {}).status_code == 200


def test_unknown_names_still_refused(daemon):
    for route, body in [("/generate", dict(GEN, max_tokens=3)), ("/v1/completions", dict(CMPL, input_ids=[1])),
                        ("/update_weight_version", {"new_version": "1", "abort": True}),
                        ("/generate", dict(GEN, sampling_params={"seed": 1}))]:
        r = daemon.post(route, body)
        assert r.status_code == 400 and "unknown field" in r.json()["error"]["message"], r.text


def test_sglang_router_reserialized_request(daemon):
    """sglang-router re-serializes each /generate with SGLang's defaults filled in."""
    body = {"text": None, "model": None, "input_ids": [5, 6, 7], "input_embeds": None, "image_data": None,
            "video_data": None, "audio_data": None,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 4, "top_p": 1.0, "top_k": -1,
                                "sampling_seed": 3},
            "return_logprob": True, "logprob_start_len": None, "top_logprobs_num": None, "token_ids_logprob": None,
            "return_text_in_logprobs": False, "stream": False, "log_metrics": True, "return_hidden_states": False,
            "modalities": None, "session_params": None, "lora_path": None, "lora_id": None,
            "custom_logit_processor": None, "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None,
            "bootstrap_pair_key": None, "data_parallel_rank": None, "data_parallel_rank_decode": None,
            "background": False, "conversation_id": None, "priority": None, "extra_key": None, "no_logs": False,
            "custom_labels": None, "return_bytes": False, "return_entropy": False, "rid": "router-1"}
    r = daemon.post("/generate", body)
    assert r.status_code == 200, r.text
    o = r.json()
    assert o["meta_info"]["id"] == "router-1" and len(o["output_ids"]) == 4


def test_sglang_router_reserialized_completion(daemon):
    """sglang-router (0.3) re-serializes each /v1/completions with SGLang's CompletionRequest defaults:
    the body below is what it sent upstream for {"model", "prompt", "max_tokens", "temperature", "seed"}
    (with the prompt as token ids, which rolloutd takes without a tokenizer)."""
    body = {"model": "default", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0, "stream": False,
            "echo": False, "seed": 3, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
            "return_hidden_states": False}
    r = daemon.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    plain = daemon.post("/v1/completions", {k: body[k] for k in ("model", "prompt", "max_tokens", "temperature")})
    assert r.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]
    r = daemon.post("/v1/completions", dict(body, rid="router-cmpl-1"))
    assert r.status_code == 200 and r.json()["id"] == "cmpl-router-cmpl-1", r.text
    for field, value in [("return_hidden_states", True), ("rid", ["a"]), ("regex", "a+"), ("routed_dp_rank", 1)]:
        r = daemon.post("/v1/completions", dict(body, **{field: value}))
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
        assert "not implemented" in r.json()["error"]["message"], r.text


def test_areal_and_slime_requests(daemon):
    """AReaL's remote SGLang engine sends image_data null and a frequency penalty; slime sends custom_params
    whenever top_p < 1 (ignored without a custom logit processor, as in SGLang)."""
    areal = {"input_ids": [5, 6, 7], "image_data": None, "return_logprob": True, "stream": False,
             "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                 "frequency_penalty": 0.2, "stop_token_ids": [2], "ignore_eos": False}}
    r = daemon.post("/generate", areal)
    assert r.status_code == 200, r.text
    slime = {"input_ids": [5, 6, 7], "return_logprob": True,
             "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "top_p": 0.7,
                                 "custom_params": {"return_top_p_token_ids": True}, "sampling_seed": 11}}
    r = daemon.post("/generate", slime)
    assert r.status_code == 200, r.text
    plain = dict(slime, sampling_params={k: v for k, v in slime["sampling_params"].items() if k != "custom_params"})
    assert daemon.post("/generate", plain).json()["output_ids"] == r.json()["output_ids"]  # no effect
    with_processor = dict(slime, custom_logit_processor="{\"callable\": \"...\"}")
    r = daemon.post("/generate", with_processor)
    assert r.status_code == 400 and r.json()["error"]["param"] == "custom_logit_processor"
    assert "not implemented" in r.json()["error"]["message"]


def test_neutral_values_are_accepted(daemon):
    body = dict(GEN, image_data=[], token_ids_logprob=[], return_hidden_states=False, routed_dp_rank=0, priority=0,
                extra_key="", custom_labels={}, return_routed_experts=False,
                sampling_params=dict(GEN["sampling_params"], stop="", stop_regex=[], logit_bias={}, beam_width=1,
                                     skip_special_tokens=True, no_stop_trim=False))
    assert daemon.post("/generate", body).status_code == 200
    body = dict(CMPL, stop=[], suffix="", logit_bias={}, use_beam_search=False, length_penalty=1.0, priority=0,
                vllm_xargs={}, logits_processors=[], max_repetition_pattern_size=0, best_of=1,
                return_tokens_as_token_ids=True, include_stop_str_in_output=False, add_special_tokens=True)
    r = daemon.post("/v1/completions", body)
    assert r.status_code == 200, r.text


def test_integral_reals_are_integers(daemon):
    """JSON Schema's "integer" (which /openapi.json states), pydantic's int (vLLM) and Python's (SGLang) all take
    4.0 for 4: a trainer whose lengths come out of float arithmetic must get what the integers give, not a 400."""
    ints = {"input_ids": [[5, 6, 7], [8, 9]], "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 1,
            "sampling_params": {"max_new_tokens": 4, "n": 2, "top_k": 5, "min_new_tokens": 1, "sampling_seed": 7,
                                "stop_token_ids": [1]}}

    def as_reals(v):
        if isinstance(v, bool):
            return v
        if isinstance(v, int):
            return float(v)
        if isinstance(v, list):
            return [as_reals(x) for x in v]
        if isinstance(v, dict):
            return {k: as_reals(x) for k, x in v.items()}
        return v

    reals = as_reals(ints)
    assert '"max_new_tokens": 4.0' in json.dumps(reals)
    a, b = daemon.post("/generate", ints), daemon.post("/generate", reals)
    assert a.status_code == 200 and b.status_code == 200, b.text

    def tokens_and_logprobs(outs):
        return [(o["output_ids"], o["meta_info"]["output_token_logprobs"], o["meta_info"]["input_token_logprobs"],
                 o["meta_info"]["output_top_logprobs"]) for o in outs]

    assert tokens_and_logprobs(a.json()) == tokens_and_logprobs(b.json())
    cmpl = {"model": "default", "prompt": [5, 6, 7], "max_tokens": 3, "n": 2, "logprobs": 2, "seed": 3,
            "temperature": 1.0}
    a, b = daemon.post("/v1/completions", cmpl), daemon.post("/v1/completions", as_reals(cmpl))
    assert a.status_code == 200 and b.status_code == 200, b.text
    assert [c["logprobs"] for c in a.json()["choices"]] == [c["logprobs"] for c in b.json()["choices"]]
    for route, body, param in [("/generate", dict(ints, sampling_params={"max_new_tokens": 2.5}),
                                "sampling_params.max_new_tokens"),
                               ("/generate", dict(ints, input_ids=[5, 6.5]), "input_ids"),
                               ("/v1/completions", dict(cmpl, max_tokens=1e300), "max_tokens")]:
        r = daemon.post(route, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_default_lengths_fit_the_cap_and_the_context(tmp_path):
    """Without max_new_tokens, SGLang's default (128) is lowered to what the server allows, as SGLang's
    scheduler lowers it to the context; a given one past the cap or the context is a 400, as SGLang
    refuses it. /v1/completions' default (16) likewise; max_tokens null is the whole room."""
    d = Daemon(None, ["--max-new-tokens", "12", "--max-context", "64"], tmp_path / "rolloutd.log")
    try:
        greedy = {"temperature": 0, "ignore_eos": True}
        r = d.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": greedy})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 12, r.text  # the cap
        long = list(range(1, 60))  # leaves 5 tokens of the 64
        r = d.post("/generate", {"input_ids": [[5, 6, 7], long], "sampling_params": greedy})
        assert r.status_code == 200 and [len(o["output_ids"]) for o in r.json()] == [5, 5], r.text
        assert r.json()[1]["meta_info"]["finish_reason"]["type"] == "length"
        # the same as asking for 5: the default is lowered, nothing else changes
        five = d.post("/generate", {"input_ids": [[5, 6, 7], long], "sampling_params": dict(greedy, max_new_tokens=5)})
        assert [o["output_ids"] for o in five.json()] == [o["output_ids"] for o in r.json()]
        for sp, param in [({"max_new_tokens": 13}, "sampling_params.max_new_tokens"),
                          ({"max_new_tokens": 6}, "input_ids[1]")]:
            r = d.post("/generate", {"input_ids": [[5, 6, 7], long], "sampling_params": sp})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        c = d.post("/v1/completions", {"prompt": long, "temperature": 0, "ignore_eos": True})
        assert c.status_code == 200 and c.json()["usage"]["completion_tokens"] == 5, c.text
        c = d.post("/v1/completions", {"prompt": [5, 6, 7], "temperature": 0, "ignore_eos": True})
        assert c.status_code == 200 and c.json()["usage"]["completion_tokens"] == 12, c.text
        c = d.post("/v1/completions", {"prompt": long, "max_tokens": 6})
        assert c.status_code == 400, c.text
        # a prompt that fills the context leaves no default to lower: a 400 naming it, not an empty output
        full = list(range(1, 65))
        r = d.post("/generate", {"input_ids": [[5, 6, 7], full], "sampling_params": greedy})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids[1]", r.text
        assert "exceeds the context limit of 64" in r.json()["error"]["message"], r.text
        c = d.post("/v1/completions", {"prompt": full})
        assert c.status_code == 400 and c.json()["error"]["param"] == "prompt", c.text
    finally:
        assert d.stop() == 0


def print_fields_bin():
    for cand in (pathlib.Path(BIN).parent / "print-fields", ROOT / "build" / "print-fields"):
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def test_field_reference_is_current():
    tool = print_fields_bin()
    if tool is None:
        pytest.skip("build/print-fields is not built (make all builds it)")
    printed = subprocess.run([str(tool)], capture_output=True, text=True, check=True, timeout=30).stdout
    doc = (ROOT / "docs" / "api-fields.md").read_text()
    assert printed == doc, "docs/api-fields.md is out of date: run `make docs`"
    for name in GENERATE_FIELDS + SAMPLING_FIELDS + COMPLETION_FIELDS:
        assert f"| `{name}`" in doc, name
