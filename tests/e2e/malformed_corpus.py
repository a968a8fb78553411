"""A corpus of malformed HTTP requests, generated from a few valid bodies plus hand-written cases.

cases(max_body_bytes) returns Case tuples: (id, method, path, body, headers, status, error type,
param). body is bytes (sent as is) or None; param None means "not checked" (some messages name a
sub-path that depends on the case). Categories:

  truncated   every proper prefix of valid /generate, /v1/completions and control bodies
  types       a wrong JSON type for every field of /generate, /v1/completions and the control routes
  numbers     huge, negative and out-of-range numbers; integers past 2^63; floats past FLT_MAX
  literals    NaN / Infinity (not JSON)
  utf8        invalid UTF-8 in values and keys, overlong forms, lone surrogates
  nesting     deeply nested arrays, in the body and inside input_ids
  oversized   bodies over max-body-bytes, with and without Content-Length
  unknown     unknown fields at every level
  unimpl      fields SGLang or vLLM define that rolloutd does not implement, at non-neutral values
              (400 "unsupported" naming the field), on every route that takes a body
  methods     every route with every method it does not take (405 + Allow)
  routes      unknown paths (404)
  framing     a body whose length is ambiguous or whose transfer coding rolloutd does not read:
              two Content-Length values, Transfer-Encoding with Content-Length, any coding but a
              lone chunked, Transfer-Encoding in HTTP/1.0 (400 at once, before the body is read,
              and the connection closed; never a hang)
  weights     weight-route fields: tensors[].crc32c and transaction_id of the wrong type or range

Framing cases are sent as raw bytes: headers holds "Raw-Headers" (header lines, CRLF-separated,
after Host and Content-Type) and optionally "Raw-Version" (default HTTP/1.1).
"""
import json
from collections import namedtuple

Case = namedtuple("Case", "id method path body headers status etype param")

GEN = {"rid": "c1", "input_ids": [1, 2, 3],
       "sampling_params": {"max_new_tokens": 2, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                           "n": 1, "sampling_seed": 7, "stop_token_ids": [5], "ignore_eos": False,
                           "min_new_tokens": 0},
       "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 0, "logprobs_mode": "default",
       "stream": False}
CMPL = {"model": "default", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
        "min_p": 0.0, "n": 1, "seed": 1, "stop_token_ids": [5], "ignore_eos": False, "logprobs": 0,
        "return_tokens_as_token_ids": True, "stream": False}

# route -> (methods it takes)
ROUTES = {
    "/health": ["GET"], "/health_generate": ["GET"], "/generate": ["POST", "PUT"], "/v1/completions": ["POST"],
    "/v1/models": ["GET"], "/get_model_info": ["GET"], "/model_info": ["GET"], "/get_server_info": ["GET"],
    "/server_info": ["GET"], "/get_load": ["GET"], "/v1/loads": ["GET"],
    "/get_weight_version": ["GET"], "/metrics": ["GET"], "/abort_request": ["POST"], "/pause_generation": ["POST"],
    "/continue_generation": ["POST"], "/flush_cache": ["GET", "POST"], "/tokenize": ["POST"],
    "/detokenize": ["POST"],
}
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH"]

WRONG = {  # kind -> values of the wrong JSON type
    "int": ["1", 1.5, True, [1], {"a": 1}],
    "float": ["1.0", True, [1.0], {"x": 1}],
    "bool": [1, 0, "true", [True], {"b": True}],
    "str": [1, True, ["s"], {"s": 1}],
    "ids": ["1 2 3", 7, True, {"0": 1}, [1.5], ["a"], [True], [None], [[1], 2]],
    "obj": ["x", 1, [1], True],
    "prompt": [7, True, {"0": 1}, [1.5], [True], [None], [[1], 2], ["a", 1], [[1], "a"]],  # strings are text
}

GEN_TOP = {"rid": "str", "input_ids": "ids", "sampling_params": "obj", "return_logprob": "bool",
           "logprob_start_len": "int", "top_logprobs_num": "int", "logprobs_mode": "str", "stream": "bool"}
GEN_SAMPLING = {"max_new_tokens": "int", "min_new_tokens": "int", "temperature": "float", "top_p": "float",
                "top_k": "int", "min_p": "float", "n": "int", "sampling_seed": "int", "stop_token_ids": "ids",
                "ignore_eos": "bool", "stream_interval": "int", "skip_special_tokens": "bool",
                "no_stop_trim": "bool", "repetition_penalty": "float"}
CMPL_TOP = {"model": "str", "prompt": "prompt", "max_tokens": "int", "temperature": "float", "top_p": "float",
            "top_k": "int", "min_p": "float", "n": "int", "seed": "int", "stop_token_ids": "ids",
            "ignore_eos": "bool", "min_tokens": "int", "logprobs": "int", "echo": "bool", "stream": "bool",
            "return_token_ids": "bool", "return_tokens_as_token_ids": "bool", "request_id": "str",
            "logprobs_mode": "str", "user": "str", "stream_options": "obj"}


def enc(v):
    return json.dumps(v).encode()


def _wrong_types():
    out = []
    for field, kind in GEN_TOP.items():
        for i, w in enumerate(WRONG[kind]):
            if field == "rid" and isinstance(w, list):
                continue  # a list of rids is a valid shape; its entries are checked (below, rid[0])
            body = dict(GEN, **{field: w})
            param = None if kind in ("ids", "prompt") else field
            out.append(Case(f"types-generate-{field}-{i}", "POST", "/generate", enc(body), {}, 400,
                            "invalid_request", param))
    out.append(Case("types-generate-rid-list-entry", "POST", "/generate", enc(dict(GEN, rid=[5])), {}, 400,
                    "invalid_request", "rid[0]"))
    for field, kind in GEN_SAMPLING.items():
        for i, w in enumerate(WRONG[kind]):
            body = dict(GEN, sampling_params=dict(GEN["sampling_params"], **{field: w}))
            out.append(Case(f"types-generate-sampling-{field}-{i}", "POST", "/generate", enc(body), {}, 400,
                            "invalid_request", None if kind == "ids" else f"sampling_params.{field}"))
    for field, kind in CMPL_TOP.items():
        for i, w in enumerate(WRONG[kind]):
            if field == "stream_options" and w is not None:
                body = dict(CMPL, stream=True, stream_options=w)
            else:
                body = dict(CMPL, **{field: w})
            etype = "invalid_request"
            out.append(Case(f"types-completions-{field}-{i}", "POST", "/v1/completions", enc(body), {}, 400, etype,
                            None if kind in ("ids", "prompt") else field))
    for i, w in enumerate(WRONG["str"] + [""]):
        out.append(Case(f"types-abort-rid-{i}", "POST", "/abort_request", enc({"rid": w}), {}, 400,
                        "invalid_request", "rid"))
    for i, w in enumerate(WRONG["bool"]):
        out.append(Case(f"types-abort-all-{i}", "POST", "/abort_request", enc({"abort_all": w}), {}, 400,
                        "invalid_request", "abort_all"))
    for i, w in enumerate(WRONG["str"] + ["keep", "ABORT", ""]):
        out.append(Case(f"types-pause-mode-{i}", "POST", "/pause_generation", enc({"mode": w}), {}, 400,
                        "invalid_request", "mode"))
    for i, body in enumerate([b"[]", b"1", b"\"x\"", b"null", b"true"]):
        for path in ("/pause_generation", "/continue_generation", "/flush_cache", "/abort_request", "/generate",
                     "/v1/completions"):
            out.append(Case(f"types-body-not-object-{path.strip('/').replace('/', '-')}-{i}", "POST", path, body,
                            {}, 400, "invalid_request", None))
    return out


def _truncated():
    out = []
    for name, path, full in [("generate", "/generate", enc(GEN)), ("completions", "/v1/completions", enc(CMPL)),
                             ("abort", "/abort_request", enc({"rid": "abc", "abort_all": False})),
                             ("pause", "/pause_generation", enc({"mode": "retract"}))]:
        for n in range(1, len(full)):
            prefix = full[:n]
            if not prefix.strip():
                continue
            out.append(Case(f"truncated-{name}-{n}", "POST", path, prefix, {}, 400, "invalid_request", None))
    return out


def _numbers():
    sp = GEN["sampling_params"]
    rows = [
        ("max-new-tokens-2^31", {"sampling_params": dict(sp, max_new_tokens=2 ** 31)}, "sampling_params.max_new_tokens"),
        ("max-new-tokens-neg", {"sampling_params": dict(sp, max_new_tokens=-5)}, "sampling_params.max_new_tokens"),
        ("max-new-tokens-huge", {"sampling_params": dict(sp, max_new_tokens=2 ** 62)}, "sampling_params.max_new_tokens"),
        ("n-huge", {"sampling_params": dict(sp, n=2 ** 40)}, "sampling_params.n"),
        ("n-neg", {"sampling_params": dict(sp, n=-1)}, "sampling_params.n"),
        ("n-over-max", {"sampling_params": dict(sp, n=65)}, "sampling_params.n"),
        ("temperature-1e300", {"sampling_params": dict(sp, temperature=1e300)}, "sampling_params.temperature"),
        ("temperature-neg-1e300", {"sampling_params": dict(sp, temperature=-1e300)}, "sampling_params.temperature"),
        ("top-p-tiny-neg", {"sampling_params": dict(sp, top_p=-1e-300)}, "sampling_params.top_p"),
        ("min-p-1e39", {"sampling_params": dict(sp, min_p=1e39)}, "sampling_params.min_p"),
        ("seed-neg", {"sampling_params": dict(sp, sampling_seed=-(2 ** 63))}, "sampling_params.sampling_seed"),
        ("top-k-neg-huge", {"sampling_params": dict(sp, top_k=-(2 ** 62))}, "sampling_params.top_k"),
        ("logprob-start-neg", {"logprob_start_len": -(2 ** 40)}, "logprob_start_len"),
        ("top-logprobs-huge", {"top_logprobs_num": 2 ** 40}, "top_logprobs_num"),
        ("top-logprobs-21", {"top_logprobs_num": 21}, "top_logprobs_num"),
        ("id-2^31", {"input_ids": [1, 2 ** 31]}, "input_ids"),
        ("id-neg", {"input_ids": [-(2 ** 62)]}, "input_ids"),
        ("id-vocab", {"input_ids": [8192]}, "input_ids"),
        ("stop-id-vocab", {"sampling_params": dict(sp, stop_token_ids=[10 ** 9])}, "sampling_params.stop_token_ids"),
        ("batch-over-max", {"input_ids": [[1]] * 1025, "sampling_params": dict(sp, n=1)}, "input_ids"),
        ("max-new-tokens-over-cap", {"sampling_params": dict(sp, max_new_tokens=40000)}, "sampling_params.max_new_tokens"),
        # min_new_tokens with every token a stop id: nothing could be sampled while they are masked
        ("stop-regex-bad", {"sampling_params": dict(sp, stop_regex=["ok", "a(b"])}, "sampling_params.stop_regex[1]"),
        ("stop-regex-17", {"sampling_params": dict(sp, stop_regex=["q"] * 17)}, "sampling_params.stop_regex[16]"),
        ("stop-regex-long", {"sampling_params": dict(sp, stop_regex="x" * 1025)}, "sampling_params.stop_regex"),
        ("min-new-tokens-all-stop", {"sampling_params": dict(sp, min_new_tokens=1, stop_token_ids=list(range(8192)))},
         "sampling_params.stop_token_ids"),
    ]
    out = [Case(f"numbers-generate-{n}", "POST", "/generate", enc(dict(GEN, **over)), {}, 400, "invalid_request", p)
           for n, over, p in rows]
    crows = [("max-tokens-2^31", {"max_tokens": 2 ** 31}, "max_tokens"), ("n-0", {"n": 0}, "n"),
             ("logprobs-21", {"logprobs": 21}, "logprobs"), ("logprobs-huge", {"logprobs": 2 ** 50}, "logprobs"),
             ("temperature-1e39", {"temperature": 1e39}, "temperature"), ("prompt-vocab", {"prompt": [9999]}, "prompt"),
             ("max-tokens-over-context", {"max_tokens": 4094}, "prompt"), ("n-over-max", {"n": 65}, "n")]
    out += [Case(f"numbers-completions-{n}", "POST", "/v1/completions", enc(dict(CMPL, **over)), {}, 400,
                 "invalid_request", p) for n, over, p in crows]
    raw = [b'{"input_ids": [9223372036854775808]}', b'{"input_ids": [-9223372036854775809]}',
           b'{"input_ids": [1], "sampling_params": {"temperature": 1e400}}',
           b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1.5e0}}',  # 1e3 is an integer, 1.5e0 not
           b'{"input_ids": [5e-1]}', b'{"input_ids": [01]}', b'{"input_ids": [+1]}', b'{"input_ids": [0x10]}',
           b'{"input_ids": [1.]}', b'{"input_ids": [.5]}']
    out += [Case(f"numbers-raw-{i}", "POST", "/generate", b, {}, 400, "invalid_request", None) for i, b in enumerate(raw)]
    return out


def _literals():
    bodies = [b'{"input_ids": [NaN]}', b'{"input_ids": [Infinity]}', b'{"input_ids": [-Infinity]}',
              b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}',
              b'{"input_ids": [1], "sampling_params": {"top_p": Infinity}}',
              b'{"input_ids": [1], "sampling_params": {"min_p": -Infinity}}',
              b'{"input_ids": [1], "return_logprob": True}', b'{"input_ids": [1], "stream": None}',
              b"{'input_ids': [1]}", b'{"input_ids": [1],}', b'{"input_ids": [1 2]}', b'{input_ids: [1]}',
              b'{"input_ids": [1]} {"input_ids": [2]}', b'{"input_ids": [1]}\x00', b'\xef\xbb\xbf{"input_ids": [1]}']
    out = [Case(f"literals-generate-{i}", "POST", "/generate", b, {}, 400, "invalid_request", None)
           for i, b in enumerate(bodies)]
    out += [Case("literals-completions-nan", "POST", "/v1/completions", b'{"prompt": [1], "temperature": NaN}', {},
                 400, "invalid_request", None),
            Case("literals-pause-inf", "POST", "/pause_generation", b'{"mode": Infinity}', {}, 400,
                 "invalid_request", None)]
    return out


def _utf8():
    bodies = [b'{"input_ids": [1], "rid": "\xff\xfe"}', b'{"input_ids": [1], "rid": "a\xc3"}',
              b'{"input_ids": [1], "rid": "\xc0\x80"}', b'{"input_ids": [1], "rid": "\xed\xa0\x80"}',
              b'{"input_ids": [1], "rid": "\\ud800"}', b'{"input_ids": [1], "rid": "\\udc00x"}',
              b'{"input_ids": [1], "\xc3\x28": 1}', b'{"input_ids": [1], "rid": "\xf8\x88\x80\x80\x80"}',
              b'{"input_ids": [1], "rid": "a\\u0000b"}', b'{"input_ids": [1], "rid": "\x01"}']
    out = [Case(f"utf8-generate-{i}", "POST", "/generate", b, {}, 400, "invalid_request", None)
           for i, b in enumerate(bodies)]
    out += [Case("utf8-completions-model", "POST", "/v1/completions", b'{"prompt": [1], "model": "\xff"}', {}, 400,
                 "invalid_request", None),
            Case("utf8-abort-rid", "POST", "/abort_request", b'{"rid": "\xfe\xff"}', {}, 400, "invalid_request", None),
            Case("utf8-abort-key", "POST", "/abort_request", b'{"\xfe": 1}', {}, 400, "invalid_request", None)]
    return out


def _nesting():
    deep = b"[" * 5000 + b"]" * 5000
    return [Case("nesting-body", "POST", "/generate", deep, {}, 400, "invalid_request", None),
            Case("nesting-input-ids", "POST", "/generate", b'{"input_ids": ' + deep + b"}", {}, 400,
                 "invalid_request", None),
            Case("nesting-input-ids-3", "POST", "/generate", enc({"input_ids": [[[1]]]}), {}, 400, "invalid_request",
                 None),
            Case("nesting-prompt", "POST", "/v1/completions", b'{"prompt": ' + deep + b"}", {}, 400,
                 "invalid_request", None),
            Case("nesting-objects", "POST", "/generate", b'{"a":' * 3000 + b"1" + b"}" * 3000, {}, 400,
                 "invalid_request", None),
            Case("nesting-unclosed", "POST", "/abort_request", b"[" * 100000, {}, 400, "invalid_request", None)]


def _oversized(max_body):
    big = b'{"input_ids": [' + b"1, " * (max_body // 3 + 10) + b"1]}"
    out = []
    for path in ("/generate", "/v1/completions", "/abort_request", "/pause_generation", "/flush_cache"):
        out.append(Case(f"oversized{path.replace('/', '-')}", "POST", path, big, {}, 413, "request_too_large", None))
    out.append(Case("oversized-declared-only", "POST", "/generate", b"{}", {"Content-Length-Override": str(2 ** 40)},
                    413, "request_too_large", None))
    return out


def _unknown():
    rows = [("generate-top", "/generate", dict(GEN, bogus=1), "bogus"),
            ("generate-sampling", "/generate", dict(GEN, sampling_params={"bogus": 1}), "sampling_params.bogus"),
            ("generate-seed", "/generate", dict(GEN, sampling_params={"seed": 1}), "sampling_params.seed"),
            ("generate-case", "/generate", {"Input_ids": [1]}, "Input_ids"),
            ("completions-top", "/v1/completions", dict(CMPL, bogus=1), "bogus"),
            ("completions-input-ids", "/v1/completions", dict(CMPL, input_ids=[1]), "input_ids"),
            ("completions-stream-options", "/v1/completions", dict(CMPL, stream=True, stream_options={"x": 1}),
             "stream_options.x"),
            ("completions-messages", "/v1/completions", dict(CMPL, messages=[]), "messages"),
            ("abort", "/abort_request", {"rid": "a", "force": True}, "force"),
            ("pause", "/pause_generation", {"mode": "abort", "timeout": 1}, "timeout"),
            ("continue", "/continue_generation", {"x": 1}, "x"),
            ("flush", "/flush_cache", {"x": 1}, "x")]
    return [Case(f"unknown-{n}", "POST", p, enc(b), {}, 400, "invalid_request", param) for n, p, b, param in rows]


def _unimplemented():
    sp = GEN["sampling_params"]
    rows = [("generate-image", "/generate", dict(GEN, image_data="http://x/a.png"), "image_data"),
            ("generate-lora", "/generate", dict(GEN, lora_path="a"), "lora_path"),
            ("generate-session", "/generate", dict(GEN, session_params={"id": "s"}), "session_params"),
            ("generate-logit-processor", "/generate", dict(GEN, custom_logit_processor="x"), "custom_logit_processor"),
            ("generate-hidden", "/generate", dict(GEN, return_hidden_states=True), "return_hidden_states"),
            ("generate-priority", "/generate", dict(GEN, priority=3), "priority"),
            ("generate-dp-rank", "/generate", dict(GEN, data_parallel_rank=2), "data_parallel_rank"),
            ("generate-background", "/generate", dict(GEN, background=True), "background"),
            ("generate-token-ids-logprob", "/generate", dict(GEN, token_ids_logprob=[1]), "token_ids_logprob"),
            ("generate-regex", "/generate", dict(GEN, sampling_params=dict(sp, regex="a+")), "sampling_params.regex"),
            ("generate-logit-bias", "/generate", dict(GEN, sampling_params=dict(sp, logit_bias={"1": 2})),
             "sampling_params.logit_bias"),
            ("generate-beam", "/generate", dict(GEN, sampling_params=dict(sp, beam_width=4)),
             "sampling_params.beam_width"),
            ("completions-suffix", "/v1/completions", dict(CMPL, suffix="x"), "suffix"),
            ("completions-beam", "/v1/completions", dict(CMPL, use_beam_search=True), "use_beam_search"),
            ("completions-allowed", "/v1/completions", dict(CMPL, allowed_token_ids=[1]), "allowed_token_ids"),
            ("completions-format", "/v1/completions", dict(CMPL, response_format={"type": "json_object"}),
             "response_format"),
            ("completions-truncate", "/v1/completions", dict(CMPL, truncate_prompt_tokens=2),
             "truncate_prompt_tokens"),
            ("completions-priority", "/v1/completions", dict(CMPL, priority=1), "priority"),
            ("completions-usage-stats", "/v1/completions",
             dict(CMPL, stream=True, stream_options={"continuous_usage_stats": True}),
             "stream_options.continuous_usage_stats"),
            ("abort-message", "/abort_request", {"rid": "a", "abort_message": "bye"}, "abort_message"),
            ("flush-timeout", "/flush_cache", {"timeout_s": 3}, "timeout_s"),
            ("pause-ipc", "/pause_generation", {"http_worker_ipc": "ipc:///x"}, "http_worker_ipc"),
            ("disk-async", "/update_weights_from_disk", {"model_path": "/m", "is_async": True}, "is_async"),
            ("disk-keep-pause", "/update_weights_from_disk", {"model_path": "/m", "keep_pause": True}, "keep_pause"),
            ("disk-manifest", "/update_weights_from_disk", {"model_path": "/m", "manifest": {"a": 1}}, "manifest")]
    return [Case(f"unimpl-{n}", "POST", p, enc(b), {}, 400, "unsupported", param) for n, p, b, param in rows]


def _methods():
    out = []
    for path, ok in ROUTES.items():
        for m in METHODS:
            if m not in ok:
                out.append(Case(f"methods-{m}{path.replace('/', '-')}", m, path, b"{}", {}, 405,
                                "method_not_allowed", None))
    return out


def _routes():
    paths = ["/", "/generate/", "/v1/completion", "/v1/chat/completions", "/health/", "/GENERATE", "/v1",
             "/v1/", "/../etc/passwd", "/generate/../health", "/%00", "/" + "a" * 4000, "/metrics/x",
             "/abort_requests", "/update_weights", "//generate",
             # an escaped NUL must not end the path early (/health, /generate are real routes)
             "/health%00/x", "/generate%00.php", "/health%00"]
    out = []
    for i, p in enumerate(paths):
        for m in ("GET", "POST"):
            out.append(Case(f"routes-{m}-{i}", m, p, b"{}", {}, 404, "not_found", None))
    return out


# A valid body for each route the framing cases go to: only the framing is wrong.
FRAMED = {"/generate": enc({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}),
          "/abort_request": enc({"rid": "framing"}), "/update_weight_version": enc({"new_version": "framing"})}


def _chunked(body):
    return b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"


def _framing():
    rows = [  # (id, header lines given the body's length n, chunked body?, HTTP version, error type)
        ("two-content-lengths", "Content-Length: {n}\r\nContent-Length: {m}", False, "HTTP/1.1", "invalid_request"),
        ("two-content-lengths-spelled", "Content-Length: {n}\r\nContent-Length: 0{n}", False, "HTTP/1.1",
         "invalid_request"),
        ("content-length-and-chunked", "Content-Length: {n}\r\nTransfer-Encoding: chunked", True, "HTTP/1.1",
         "invalid_request"),
        ("chunked-and-content-length", "Transfer-Encoding: chunked\r\nContent-Length: {n}", True, "HTTP/1.1",
         "invalid_request"),
        ("gzip-chunked", "Transfer-Encoding: gzip, chunked", True, "HTTP/1.1", "unsupported"),
        ("deflate-chunked-two-headers", "Transfer-Encoding: deflate\r\nTransfer-Encoding: chunked", True,
         "HTTP/1.1", "unsupported"),
        ("gzip", "Transfer-Encoding: gzip", False, "HTTP/1.1", "invalid_request"),
        ("identity", "Transfer-Encoding: identity", False, "HTTP/1.1", "invalid_request"),
        ("chunked-gzip", "Transfer-Encoding: chunked, gzip", True, "HTTP/1.1", "invalid_request"),
        ("chunked-twice", "Transfer-Encoding: chunked, chunked", True, "HTTP/1.1", "invalid_request"),
        ("gzip-chunked-chunked", "Transfer-Encoding: gzip, chunked, chunked", True, "HTTP/1.1", "invalid_request"),
        ("chunked-two-headers", "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked", True, "HTTP/1.1",
         "invalid_request"),
        ("empty-coding", "Transfer-Encoding: ,", False, "HTTP/1.1", "invalid_request"),
        # one coding, chunked, but not the whole value: libmicrohttpd would read these bodies to the close
        ("chunked-comma", "Transfer-Encoding: chunked,", True, "HTTP/1.1", "invalid_request"),
        ("comma-chunked", "Transfer-Encoding: ,chunked", True, "HTTP/1.1", "invalid_request"),
        ("chunked-comma-space", "Transfer-Encoding: chunked, ", True, "HTTP/1.1", "invalid_request"),
        ("chunked-tab", "Transfer-Encoding: chunked\t", True, "HTTP/1.1", "invalid_request"),
        ("http10-chunked", "Transfer-Encoding: chunked", True, "HTTP/1.0", "invalid_request"),
    ]
    out = []
    for path, body in FRAMED.items():
        for name, lines, chunked, version, etype in rows:
            raw = lines.format(n=len(body), m=len(body) - 2)
            out.append(Case(f"framing-{name}{path.replace('/', '-')}", "POST", path,
                            _chunked(body) if chunked else body, {"Raw-Headers": raw, "Raw-Version": version}, 400,
                            etype, None))
    out.append(Case("framing-gzip-on-get", "GET", "/health", b"", {"Raw-Headers": "Transfer-Encoding: gzip"}, 400,
                    "invalid_request", None))
    return out


def _weights():
    t = {"name": "model.norm.weight", "dtype": "bfloat16", "shape": [8], "offset": 0}
    shm = {"shm_name": "/rolloutd-corpus-none", "tensors": [t], "is_last": True, "weight_version": "c"}
    rows = [("crc-neg", dict(shm, tensors=[dict(t, crc32c=-1)]), "tensors[0].crc32c"),
            ("crc-2^32", dict(shm, tensors=[dict(t, crc32c=2 ** 32)]), "tensors[0].crc32c"),
            ("crc-str", dict(shm, tensors=[dict(t, crc32c="e3069283")]), "tensors[0].crc32c"),
            ("crc-float", dict(shm, tensors=[dict(t, crc32c=1.5)]), "tensors[0].crc32c"),
            ("txn-empty", dict(shm, transaction_id=""), "transaction_id"),
            ("txn-long", dict(shm, transaction_id="t" * 64), "transaction_id"),
            ("txn-int", dict(shm, transaction_id=5), "transaction_id"),
            ("txn-control", dict(shm, transaction_id="a\nb"), "transaction_id")]
    out = [Case(f"weights-shm-{n}", "POST", "/update_weights_from_shm", enc(b), {}, 400, "invalid_request", p)
           for n, b, p in rows]
    dist = {"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[8]], "transaction_id": ["x"]}
    out.append(Case("weights-dist-txn-list", "POST", "/update_weights_from_distributed", enc(dist), {}, 400,
                    "invalid_request", "transaction_id"))
    return out


def cases(max_body_bytes):
    out = (_truncated() + _wrong_types() + _numbers() + _literals() + _utf8() + _nesting() +
           _oversized(max_body_bytes) + _unknown() + _unimplemented() + _methods() + _routes() + _framing() +
           _weights())
    ids = [c.id for c in out]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    return out
