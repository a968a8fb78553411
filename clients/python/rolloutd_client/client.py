"""HTTP client for rolloutd (docs/api.md): generation, control, weight updates."""
import math
import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import requests

from . import shm as _shm
from . import tensors as _tensors


class RolloutdError(Exception):
    """A non-2xx answer. .status (HTTP code), .message / .type / .param from the error body
    ({"error": {...}}, or SGLang's {"success": false, "message": ...}), .body (parsed JSON or text),
    .path (the route)."""

    def __init__(self, status, body, path):
        self.status, self.body, self.path = status, body, path
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            self.message, self.type, self.param = err.get("message"), err.get("type"), err.get("param")
        elif isinstance(body, dict):
            self.message, self.type, self.param = body.get("message"), None, None
        else:
            self.message, self.type, self.param = (str(body)[:500] if body else None), None, None
        super().__init__(f"{path} -> {status}: {self.message}")

    def __reduce__(self):  # survives pickle (Ray, multiprocessing): rebuilt from what __init__ takes
        return type(self), (self.status, self.body, self.path)


@dataclass
class GenerateResult:
    """One output of /generate. Arrays are numpy; logprob arrays are None unless requested."""
    output_ids: np.ndarray                      # int64 [completion_tokens]
    output_logprobs: Optional[np.ndarray]       # float64 [completion_tokens]
    finish_reason: Optional[str]                # "stop" | "length" | "abort"
    weight_version: Optional[str]               # the label meta_info reports
    weight_versions: List[Tuple[str, int, int]]  # (version, start, end) over output tokens
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    num_retractions: int = 0
    rid: Optional[str] = None
    e2e_latency: Optional[float] = None
    finish: Dict[str, Any] = field(default_factory=dict)     # the finish_reason object as sent
    input_ids: Optional[np.ndarray] = None                   # int64, when prompt logprobs were asked
    input_logprobs: Optional[np.ndarray] = None              # float64, NaN at the first position
    output_top_logprobs: List[Any] = field(default_factory=list)
    meta: Dict[str, Any] = field(default_factory=dict)       # meta_info as sent
    spans_reported: bool = False                             # whether the server sent per-token spans
    server: Optional[str] = None                             # the URL that answered (Client.url)

    def token_versions(self):
        """The weight version of every output token (a list of len(output_ids))."""
        out = []
        for v, s, e in self.weight_versions:
            out += [v] * (e - s)
        return out


def _spans(meta, n_out):
    """meta_info's version spans as [(version, start, end)]. Accepts a list of
    {"version"|"weight_version", "start", "end"} objects, [version, start, end] triples, or one
    version per token; without any, one span of meta_info.weight_version over every token."""
    raw = meta.get("weight_versions")
    if raw is None:
        raw = meta.get("weight_version_spans")
    if not raw:
        v = meta.get("weight_version")
        return ([(v, 0, n_out)] if n_out else []), False
    if all(isinstance(x, str) for x in raw) and len(raw) == n_out:
        spans = []
        for i, v in enumerate(raw):
            if spans and spans[-1][0] == v:
                spans[-1] = (v, spans[-1][1], i + 1)
            else:
                spans.append((v, i, i + 1))
        return spans, True
    spans = []
    for x in raw:
        if isinstance(x, dict):
            v = x.get("version", x.get("weight_version"))
            spans.append((str(v), int(x["start"]), int(x["end"])))
        else:
            v, s, e = x
            spans.append((str(v), int(s), int(e)))
    return spans, True


def _int(v, what):
    """v as a Python int (np.int64 and other integer types included; a float is a TypeError)."""
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{what}: expected an integer, got {type(v).__name__} {v!r}") from None


def _is_seq(v):
    return isinstance(v, (list, tuple)) or getattr(v, "ndim", 0) >= 1


def _token_list(x, what):
    """One sequence of token ids (list, tuple, 1-D numpy array or torch tensor) as a list of ints."""
    if not isinstance(x, (list, tuple)) and hasattr(x, "tolist"):
        x = x.tolist()
    if not isinstance(x, (list, tuple)):
        raise TypeError(f"{what}: expected a sequence of token ids, got {type(x).__name__}")
    return [_int(t, what) for t in x]


def _prompts(input_ids):
    """input_ids as JSON: one prompt ([int]) or a batch ([[int]]), from lists, tuples, numpy arrays
    (1-D, 2-D, or a list of 1-D: a ragged batch) or torch tensors, with numpy integer elements."""
    x = input_ids
    if not isinstance(x, (list, tuple)) and hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (list, tuple)) and x and _is_seq(x[0]):
        return [_token_list(s, f"input_ids[{i}]") for i, s in enumerate(x)]
    return _token_list(x, "input_ids")


def _py(v):
    """A numpy scalar (np.int64, np.float32, np.bool_) as the Python value json can write; anything
    else unchanged (the server validates it)."""
    return v.item() if isinstance(v, np.generic) else v


def parse_output(obj):
    meta = obj.get("meta_info") or {}
    ids = np.asarray(obj.get("output_ids") or [], dtype=np.int64)
    lps = meta.get("output_token_logprobs")
    out_lp = None
    if lps:
        out_lp = np.array([math.nan if e[0] is None else e[0] for e in lps], dtype=np.float64)
    elif lps == [] and len(ids) == 0:
        out_lp = np.zeros(0)
    in_ids = in_lp = None
    ilp = meta.get("input_token_logprobs")
    if ilp:
        in_lp = np.array([math.nan if e[0] is None else e[0] for e in ilp], dtype=np.float64)
        in_ids = np.array([e[1] for e in ilp], dtype=np.int64)
    fr = meta.get("finish_reason") or {}
    spans, reported = _spans(meta, len(ids))
    return GenerateResult(
        output_ids=ids, output_logprobs=out_lp,
        finish_reason=fr.get("type") if isinstance(fr, dict) else fr,
        weight_version=meta.get("weight_version"), weight_versions=spans,
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        completion_tokens=int(meta.get("completion_tokens") or len(ids)),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        num_retractions=int(meta.get("num_retractions") or 0),
        rid=meta.get("id"), e2e_latency=meta.get("e2e_latency"),
        finish=fr if isinstance(fr, dict) else {"type": fr},
        input_ids=in_ids, input_logprobs=in_lp,
        output_top_logprobs=meta.get("output_top_logprobs") or [], meta=meta, spans_reported=reported)


@dataclass
class PushResult:
    """What push_weights did: the final (is_last) response, payload bytes sent (after FP8
    quantization, if any), wall seconds from the first pack to the last answer, GB/s (1e9 bytes/s),
    number of POSTs, and the sum of the server's own "seconds"."""
    response: Dict[str, Any]
    bytes: int
    seconds: float
    gb_per_s: float
    posts: int
    server_seconds: float
    transport: str = "shm"

    @property
    def weight_version(self):
        return self.response.get("weight_version") if self.response else None


class Client:
    """rolloutd HTTP client.

        c = Client("http://127.0.0.1:30000")
        outs = c.generate([[1, 2, 3]], n=4, max_new_tokens=256, temperature=1.0)
        res = c.push_weights(model.state_dict(), version="18")           # shm, BF16
        res = c.push_weights(sd, version="19", fp8=True)                  # E4M3 + _scale_inv

    Every method raises RolloutdError on a non-2xx answer (requests' exceptions on transport errors).
    """

    def __init__(self, url, api_key=None, timeout=600.0, session=None):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.session = session or requests.Session()
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._segments = _shm.SegmentPool()  # kept bucket segments (push_weights keep_segments=True)
        self._push_lock = threading.Lock()    # one shm push at a time per Client (shared segments)

    def close(self):
        """Unlinks kept shm segments and closes the HTTP session."""
        with self._push_lock:
            self._segments.close()
        self.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ plumbing
    def request(self, method, path, body=None, timeout=None, expect_json=True):
        """One request; returns the parsed JSON (or text); RolloutdError on non-2xx."""
        r = self.session.request(method, self.url + path, json=body, headers=self.headers,
                                 timeout=self.timeout if timeout is None else timeout)
        try:
            data = r.json() if r.content else {}
        except ValueError:
            data = r.text
        if not 200 <= r.status_code < 300:
            raise RolloutdError(r.status_code, data, path)
        if expect_json and isinstance(data, dict) and data.get("success") is False:
            raise RolloutdError(r.status_code, data, path)
        return data

    def post(self, path, body=None, timeout=None):
        return self.request("POST", path, {} if body is None else body, timeout)

    def get(self, path, timeout=None):
        return self.request("GET", path, None, timeout)

    # ------------------------------------------------------------ generation
    def generate(self, input_ids, n=1, max_new_tokens=None, temperature=None, top_p=None, top_k=None,
                 min_p=None, sampling_seed=None, stop_token_ids=None, ignore_eos=None, min_new_tokens=None,
                 return_logprob=True, logprob_start_len=-1, top_logprobs_num=None, logprobs_mode=None,
                 rid=None, extra_sampling_params=None, extra=None, timeout=None):
        """POST /generate. input_ids: one prompt (list of ints) or a batch (list of lists); numpy
        arrays (1-D, 2-D, or a list of 1-D for a ragged batch), torch tensors and numpy integers
        are accepted, as are numpy values for the sampling parameters.
        Returns a list of GenerateResult, in the server's order (prompt-major, then sample), also
        for one prompt with n=1. Parameters left at None take the server's default."""
        sp = {"n": n, "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
              "top_k": top_k, "min_p": min_p, "sampling_seed": sampling_seed,
              "stop_token_ids": _token_list(stop_token_ids, "stop_token_ids") if stop_token_ids is not None else None,
              "ignore_eos": ignore_eos, "min_new_tokens": min_new_tokens}
        sp = {k: _py(v) for k, v in sp.items() if v is not None}
        if n == 1:
            sp.pop("n")
        sp.update(extra_sampling_params or {})
        body = {"input_ids": _prompts(input_ids), "sampling_params": sp, "return_logprob": bool(return_logprob)}
        if return_logprob and logprob_start_len is not None:
            body["logprob_start_len"] = _py(logprob_start_len)
        if top_logprobs_num is not None:
            body["top_logprobs_num"] = _py(top_logprobs_num)
        if logprobs_mode is not None:
            body["logprobs_mode"] = logprobs_mode
        if rid is not None:
            body["rid"] = rid
        body.update(extra or {})
        data = self.post("/generate", body, timeout)
        out = [parse_output(o) for o in (data if isinstance(data, list) else [data])]
        for o in out:
            o.server = self.url
        return out

    def score(self, input_ids, logprob_start_len=0, timeout=None):
        """Teacher forcing: prompt logprobs of each sequence (max_new_tokens 0). Returns one float64
        array per sequence, NaN where the server sends null (the first position)."""
        ids = _prompts(input_ids)
        batch = ids if ids and isinstance(ids[0], list) else [ids]
        res = self.generate(batch, max_new_tokens=0, logprob_start_len=logprob_start_len, timeout=timeout)
        return [r.input_logprobs for r in res]

    # ------------------------------------------------------------ operations
    def health(self, timeout=5.0):
        """True when GET /health answers 200 (False on 503 or no connection)."""
        try:
            r = self.session.get(self.url + "/health", headers=self.headers, timeout=timeout)
        except requests.RequestException:
            return False
        return r.status_code == 200

    def wait_ready(self, timeout=120.0, interval=0.1):
        import time
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.health(timeout=interval * 10):
                return True
            time.sleep(interval)
        raise TimeoutError(f"{self.url} did not become healthy within {timeout} s")

    def get_model_info(self):
        return self.get("/get_model_info")

    def get_server_info(self):
        return self.get("/get_server_info")

    def metrics(self):
        r = self.session.get(self.url + "/metrics", headers=self.headers, timeout=self.timeout)
        if r.status_code != 200:
            raise RolloutdError(r.status_code, r.text, "/metrics")
        return r.text

    def pause(self, mode="abort"):
        """POST /pause_generation: "abort" | "retract" | "in_place"."""
        return self.post("/pause_generation", {"mode": mode})

    def continue_generation(self):
        return self.post("/continue_generation", {})

    def flush_cache(self):
        return self.post("/flush_cache", {})

    def abort(self, rid=None):
        """Abort one request by rid, or every request when rid is None."""
        return self.post("/abort_request", {"rid": rid} if rid is not None else {"abort_all": True})

    # ------------------------------------------------------------ weights
    def get_weight_version(self):
        return self.get("/get_weight_version").get("weight_version")

    def update_weight_version(self, version, abort_all_requests=False):
        return self.post("/update_weight_version", {"new_version": str(version),
                                                    "abort_all_requests": bool(abort_all_requests)})

    def update_from_disk(self, path, version=None, timeout=None):
        """POST /update_weights_from_disk; path must lie under the daemon's allowed_weight_dir."""
        body = {"model_path": str(path)}
        if version is not None:
            body["weight_version"] = str(version)
        return self.post("/update_weights_from_disk", body, timeout)

    def update_weights_from_shm(self, shm_name, tensors, is_last, weight_version=None, timeout=None):
        """One raw bucket: tensors = [{"name", "dtype", "shape", "offset"}] already written to the
        segment `shm_name`. push_weights does the packing; this is for custom transports/tests."""
        body = {"shm_name": shm_name, "tensors": tensors, "is_last": bool(is_last)}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return self.update_weights_from_shm_body(body, timeout)

    def update_weights_from_shm_body(self, body, timeout=None):
        return self.post("/update_weights_from_shm", body, timeout)

    def init_weights_update_group(self, **body):
        return self.post("/init_weights_update_group", body)

    def update_weights_from_distributed(self, **body):
        return self.post("/update_weights_from_distributed", body)

    def destroy_weights_update_group(self, group_name):
        return self.post("/destroy_weights_update_group", {"group_name": group_name})

    def push_weights(self, state_dict, version, transport="shm", bucket_bytes=512 << 20, fp8=False,
                     fp8_filter=None, timeout=None, keep_segments=True, checksums=True, **transport_kwargs):
        """Push a full model (every parameter, HF names) as weight version `version`.

        state_dict: name -> torch tensor (any device; bf16/fp16/fp32/fp8), numpy array (float32,
        float16, ml_dtypes bfloat16 / float8_e4m3fn) or (bytes, dtype, shape); see tensors.py.
        transport "shm": buckets of bucket_bytes in POSIX shared memory (shm.py; a tensor larger
        than a bucket gets a segment of its own); "nccl": rolloutd_client.nccl.push_weights_nccl.
        fp8=True: q/k/v/o, gate/up/down and expert matrices are quantized here (128x128 blocks,
        docs/design.md "Numerics"; fp8.py) and sent as float8_e4m3fn + `<name>_scale_inv`, half the
        bytes; fp8_filter(name) overrides which names.
        keep_segments (shm, default True): keep the bucket segments (two, plus one for tensors
        larger than a bucket) allocated for the next push instead of unlinking them: allocating
        tmpfs pages costs more than copying into them, and rolloutd keeps its mappings of segments
        that stay (a 1.19 GB push on 2 cores: ~0.11 s kept, 1-2 s fresh; see shm.py). They are
        unlinked by close(), on error, and at exit (also if the process dies: they are registered
        with multiprocessing's resource tracker). False: fresh segments, unlinked after the push.
        checksums (shm, default True): send each tensor's CRC-32C (the crc32c package), which
        rolloutd checks as it reads the segment: bytes that change under its read (a second
        writer, a truncation) are refused with 400 instead of served.
        Returns PushResult; raises RolloutdError when the server refuses a bucket (the update is
        then void and the previous weights keep serving). Any other failure once a bucket was sent
        (an exception while packing, Ctrl-C, a POST timeout) ends the server's open update as well
        (shm.abort_update, which never commits) before it propagates, so the next push is not refused
        with 409. rolloutd_client.Fleet pushes one update to many daemons at once."""
        if transport == "nccl":
            from .nccl import push_weights_nccl
            return push_weights_nccl(self, state_dict, version, bucket_bytes=bucket_bytes, fp8=fp8,
                                     fp8_filter=fp8_filter, timeout=timeout, **transport_kwargs)
        if transport != "shm":
            raise ValueError(f"transport must be 'shm' or 'nccl', got {transport!r}")
        if transport_kwargs:
            raise TypeError(f"unexpected arguments for shm: {sorted(transport_kwargs)}")
        ents = _tensors.entries(state_dict, fp8=fp8, fp8_filter=fp8_filter)
        with self._push_lock:
            resp, nbytes, secs, posts, server_s = _shm.push_shm(self, ents, version, int(bucket_bytes), timeout,
                                                                self._segments if keep_segments else None,
                                                                checksums=checksums)
        return PushResult(response=resp, bytes=nbytes, seconds=secs,
                          gb_per_s=nbytes / secs / 1e9 if secs > 0 else math.inf, posts=posts,
                          server_seconds=server_s, transport="shm")
