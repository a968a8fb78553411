"""NCCL weight updates end to end, on a GPU machine (scripts/gpu-check.sh runs this file).

This process is the trainer, NCCL rank 0 and the broadcast root; a rolloutd built with
`make CUDA=1` (ROLLOUTD_BIN) serves tests/fixtures/models/qwen3/ in BF16 and joins as rank 1. The
trainer pushes qwen3/perturbed/ (qwen3 after a pretend training step; scripts/make_fixtures.py) with
rolloutd_client.nccl, and the daemon must then reproduce the perturbed model's golden.json
(transformers' logprobs and greedy tokens, test_golden's TOL):
  - flattened buckets (load_format "flattened_bucket", 64 KiB buckets: several requests, the
    96 KiB embedding alone) from host tensors, committed by the last bucket (is_last);
  - back to the original weights, one broadcast per tensor (load_format null) from CUDA tensors;
  - a request naming a tensor the model lacks is refused (400), the weights and version in service
    do not change, and the group stays in step: the next push through it works;
  - destroying the group, after which an update through it is a 400; the daemon exits cleanly.
test_nccl_fleet_push_all_or_none pushes to two daemons as one fleet (rolloutd_client.Fleet: one group,
world size 3, each daemon at its rank_offset): both serve the perturbed golden model, a push one
daemon refuses (another writer holds its update: 409) leaves both on the version they served with
unchanged logprobs, and the group stays usable for a per-tensor push back.
test_sglang_trainer_over_tcpstore does the same from a trainer that uses torch.distributed only,
as SGLang's trainers do: the TCPStore rendezvous (init_method tcp://, no unique id) and
dist.broadcast per tensor and of a flattened bucket; it needs torch's NCCL to be the release
rolloutd links.

One GPU or two. NCCL does not allow two ranks of a communicator on the same GPU: it fails the
init with "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device ..." (ncclInvalidUsage,
a check since NCCL 2.5; NVIDIA/nccl#418, where the maintainer adds that it would not work even
without the check), and NCCL's guide says so ("Using the same CUDA device multiple times as
different ranks of the same NCCL communicator is not supported"). With 2+ GPUs the daemon gets the
second visible GPU. With one, the test emulates two hosts: the check compares (host hash, bus id),
and the host hash comes from NCCL_HOSTID when set, so the two processes get different NCCL_HOSTID
values and talk over loopback sockets (P2P, SHM, IB, NVLS and MNNVL off). That is outside what
NCCL supports, so before relying on it the test runs a probe (two bare ranks broadcasting 1 MiB on
GPU 0); if the probe fails, the test skips and says that it needs 2 GPUs. ROLLOUTD_NCCL_SAME_GPU=0
skips the emulation outright.

Both sides must load the same NCCL release: the trainer loads the libnccl.so.2 that ROLLOUTD_BIN
resolves (ldd), or ROLLOUTD_NCCL_SO.
"""
import base64
import concurrent.futures as cf
import datetime
import json
import os
import pathlib
import re
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "python"))
from rolloutd_client import Client, RolloutdError  # noqa: E402
from rolloutd_client.safetensors import load_file  # noqa: E402

from test_golden import BF16_ARGS, check_greedy, check_prompt_logprobs, greedy_body, score_body  # noqa: E402

MODELS = ROOT / "tests" / "fixtures" / "models"
ORIG = MODELS / "qwen3"
PERT = ORIG / "perturbed"
BIN = os.environ.get("ROLLOUTD_BIN", str(ROOT / "build" / "rolloutd"))
GROUP = "g-e2e"
TIMEOUT = 120.0   # trainer-side waits (joins, broadcasts)

# Two "hosts" on one GPU (see the module docstring). NCCL_HOSTID is added per process.
SAME_GPU_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket",
                "NCCL_SOCKET_IFNAME": "lo", "NCCL_NVLS_ENABLE": "0", "NCCL_MNNVL_ENABLE": "0",
                "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")}
NEEDS_2_GPUS = ("NCCL rejects two ranks on one GPU ('Duplicate GPU detected', NVIDIA/nccl#418): this test needs "
                "2 GPUs")


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


TORCH = _torch_cuda() if __name__ != "__main__" else None
needs_gpu = [
    pytest.mark.skipif(TORCH is None, reason="needs PyTorch with a CUDA device (scripts/gpu-check.sh)"),
    pytest.mark.skipif(not (PERT / "golden.json").is_file(), reason="no qwen3/perturbed fixture"),
]


def nccl_so():
    """The libnccl.so.2 rolloutd runs with (the trainer must use the same release)."""
    if os.environ.get("ROLLOUTD_NCCL_SO"):
        return os.environ["ROLLOUTD_NCCL_SO"]
    try:
        out = subprocess.run(["ldd", BIN], capture_output=True, text=True, timeout=30).stdout
        m = re.search(r"libnccl\.so\.2 => (\S+)", out)
        if m and os.path.exists(m.group(1)):
            return m.group(1)
    except (OSError, subprocess.SubprocessError):
        pass
    cuda = "/usr/local/cuda/lib64/libnccl.so.2"
    return cuda if os.path.exists(cuda) else "libnccl.so.2"


# ------------------------------------------------------------------------------------------------
# the one-GPU probe: two bare ranks (this file run as a script) broadcast 1 MiB on GPU 0

def _probe_rank(rank, so, uid_b64):
    import torch
    from rolloutd_client import nccl as rn
    torch.cuda.set_device(0)
    lib = rn.load_nccl(so)
    if rank == 0:
        uid, b64 = rn.new_unique_id(lib)
        print(b64, flush=True)
    else:
        uid = rn.unique_id_from_b64(uid_b64)
    comm = rn.join_comm(lib, uid, 2, rank, 60.0, what="probe")
    g = rn.NcclGroup(lib, comm, [], "probe", 2, 0, 60.0)
    want = (torch.arange(1 << 20, device="cuda:0") * 7 % 251).to(torch.uint8)
    buf = want.clone() if rank == 0 else torch.zeros_like(want)
    g.broadcast(buf)
    torch.cuda.synchronize()
    ok = bool(torch.equal(buf, want))
    g.abort()
    print("probe-ok" if ok else "probe-mismatch", flush=True)
    return 0 if ok else 1


def _rank_env(rank):
    env = dict(os.environ, **SAME_GPU_ENV, NCCL_HOSTID=f"rolloutd-e2e-host{rank}")
    env["PYTHONPATH"] = str(ROOT / "clients" / "python") + os.pathsep + env.get("PYTHONPATH", "")
    return env


_PROBE = {}


def same_gpu_probe(so):
    """None if two emulated hosts can broadcast on GPU 0, else why not."""
    if "result" in _PROBE:
        return _PROBE["result"]
    me = str(pathlib.Path(__file__).resolve())
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(2)]
    procs = []
    why = None
    try:
        p0 = subprocess.Popen([sys.executable, me, "--probe-rank", "0", so], env=_rank_env(0),
                              stdout=subprocess.PIPE, stderr=logs[0], text=True)
        procs.append(p0)
        ready, _, _ = select.select([p0.stdout], [], [], 90)
        uid = p0.stdout.readline().strip() if ready else ""
        if not uid:
            why = "rank 0 made no unique id"
        else:
            p1 = subprocess.Popen([sys.executable, me, "--probe-rank", "1", so, uid], env=_rank_env(1),
                                  stdout=subprocess.PIPE, stderr=logs[1], text=True)
            procs.append(p1)
            out1, _ = p1.communicate(timeout=150)
            p0.communicate(timeout=30)
            if p0.returncode != 0 or p1.returncode != 0 or "probe-ok" not in out1:
                why = f"rank 0 exited {p0.returncode}, rank 1 exited {p1.returncode}"
    except subprocess.TimeoutExpired:
        why = "the probe timed out"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if why:
        tails = []
        for r, f in enumerate(logs):
            f.seek(0)
            lines = [x for x in f.read().strip().splitlines() if x.strip()]
            if lines:
                tails.append(f"rank {r}: " + " | ".join(lines[-2:]))
        why = "; ".join([why] + tails)
    for f in logs:
        f.close()
    _PROBE["result"] = why
    return why


def layout():
    """(trainer device, env for the daemon, env for this process) or pytest.skip."""
    n = TORCH.cuda.device_count()
    if n >= 2:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [x for x in visible.split(",") if x.strip()] if visible else [str(i) for i in range(n)]
        return 0, {"CUDA_VISIBLE_DEVICES": ids[1]}, {}
    if os.environ.get("ROLLOUTD_NCCL_SAME_GPU") == "0":
        pytest.skip(NEEDS_2_GPUS + " (ROLLOUTD_NCCL_SAME_GPU=0: no same-GPU emulation)")
    why = same_gpu_probe(nccl_so())
    if why:
        pytest.skip(f"{NEEDS_2_GPUS}; the NCCL_HOSTID two-host emulation failed on this machine: {why}")
    return 0, dict(SAME_GPU_ENV, NCCL_HOSTID="rolloutd-e2e-host1"), dict(SAME_GPU_ENV,
                                                                        NCCL_HOSTID="rolloutd-e2e-host0")


def fleet_layout(n_daemons):
    """(trainer device, [env of each daemon], env for this process) for a group of 1 + n_daemons
    ranks, or pytest.skip: a GPU each where there are enough, else every rank on GPU 0 as an
    emulated host of its own (NCCL_HOSTID; the module docstring)."""
    n = TORCH.cuda.device_count()
    if n >= 1 + n_daemons:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [x for x in visible.split(",") if x.strip()] if visible else [str(i) for i in range(n)]
        return 0, [{"CUDA_VISIBLE_DEVICES": ids[1 + k]} for k in range(n_daemons)], {}
    if os.environ.get("ROLLOUTD_NCCL_SAME_GPU") == "0":
        pytest.skip(f"needs {1 + n_daemons} GPUs (ROLLOUTD_NCCL_SAME_GPU=0: no same-GPU emulation)")
    why = same_gpu_probe(nccl_so())
    if why:
        pytest.skip(f"needs {1 + n_daemons} GPUs; the NCCL_HOSTID emulation failed on this machine: {why}")
    env = {"CUDA_VISIBLE_DEVICES": os.environ["CUDA_VISIBLE_DEVICES"].split(",")[0]} \
        if os.environ.get("CUDA_VISIBLE_DEVICES") else {}
    return (0, [dict(SAME_GPU_ENV, NCCL_HOSTID=f"rolloutd-e2e-host{1 + k}", **env) for k in range(n_daemons)],
            dict(SAME_GPU_ENV, NCCL_HOSTID="rolloutd-e2e-host0"))


def start_with_env(rolloutd, monkeypatch, env, *args):
    """A daemon started with `env` on top of this process's environment (which is restored)."""
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        return rolloutd(*args)
    finally:
        for k, v in saved.items():
            if v is None:
                monkeypatch.delenv(k)
            else:
                monkeypatch.setenv(k, v)


# ------------------------------------------------------------------------------------------------
# the test

def golden(d):
    return json.loads((d / "golden.json").read_text())


def raw_weights(d):
    """name -> (memoryview, "bfloat16", shape)."""
    return load_file(d / "model.safetensors", raw=True)


def cuda_weights(d, device):
    torch = TORCH
    out = {}
    for k, (mv, dt, shape) in raw_weights(d).items():
        assert dt == "bfloat16", (k, dt)
        t = torch.frombuffer(bytearray(mv), dtype=torch.bfloat16).reshape(shape)
        out[k] = t.to(f"cuda:{device}")
    return out


def check_golden(d, g, label):
    for i, p in enumerate(g["prompts"]):
        r = d.post("/generate", score_body(p["input_ids"]))
        assert r.status_code == 200, r.text
        check_prompt_logprobs(label, i, p, r.json())
        r = d.post("/generate", greedy_body(p["input_ids"]))
        assert r.status_code == 200, r.text
        check_greedy(label, i, p, r.json())


def scores(d, prompts):
    r = d.post("/generate", score_body([p["input_ids"] for p in prompts]))
    assert r.status_code == 200, r.text
    return [[e[0] for e in o["meta_info"]["input_token_logprobs"]] for o in r.json()]


def test_nccl_client_without_gpu():
    """Anywhere: the client module imports without torch, CUDA or libnccl, plans buckets in order,
    and says what is missing instead of failing obscurely."""
    code = ("import sys; import rolloutd_client, rolloutd_client.nccl as n; "
            "assert 'torch' not in sys.modules, 'importing rolloutd_client.nccl imported torch'; "
            "assert not n._libs, 'importing rolloutd_client.nccl loaded libnccl'")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "clients" / "python"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    from rolloutd_client import nccl as rn
    from rolloutd_client import tensors as rt
    ents = rt.entries({"a": (bytes(10), "bfloat16", (5,)), "b": (bytes(100), "bfloat16", (50,)),
                       "c": (bytes(4), "float32", (1,)), "d": (bytes(2), "bfloat16", (1,))})
    assert [[e.name for e in b] for b in rn.plan_buckets(ents, 16)] == [["a"], ["b"], ["c", "d"]]
    assert [[e.name for e in b] for b in rn.plan_buckets(ents, 1 << 20)] == [["a", "b", "c", "d"]]
    with pytest.raises(rn.NcclError, match="ROLLOUTD_NCCL_SO"):
        rn.load_nccl("/nonexistent/libnccl.so.2")
    uid_b64 = base64.b64encode(bytes(range(128))).decode()
    assert bytes(b & 0xFF for b in rn.unique_id_from_b64(uid_b64).internal) == bytes(range(128))
    with pytest.raises(ValueError):
        rn.unique_id_from_b64("AAAA")
    if TORCH is None:
        with pytest.raises(rn.NcclError, match="CUDA|PyTorch"):
            rn.init_group(Client("http://127.0.0.1:9"), group_name="never")


@needs_gpu[0]
@needs_gpu[1]
def test_nccl_push_matches_golden(rolloutd, monkeypatch):
    from rolloutd_client import nccl as rn

    device, daemon_env, trainer_env = layout()
    saved = {k: os.environ.get(k) for k in daemon_env}
    for k, v in daemon_env.items():
        monkeypatch.setenv(k, v)
    d = rolloutd(ORIG, *BF16_ARGS)              # inherits daemon_env
    for k, v in saved.items():
        if v is None:
            monkeypatch.delenv(k)
        else:
            monkeypatch.setenv(k, v)
    for k, v in trainer_env.items():            # read by NCCL at this process's first join
        monkeypatch.setenv(k, v)

    c = Client(d.url)
    so = nccl_so()
    g_orig, g_pert = golden(ORIG), golden(PERT)
    try:
        t0 = time.monotonic()
        group = rn.init_group(c, group_name=GROUP, device=device, timeout=TIMEOUT, nccl_so=so)
    except RolloutdError as e:
        if e.status == 400 and "CUDA build" in (e.message or ""):
            pytest.skip(f"{BIN} is not a CUDA build (make CUDA=1): {e.message}")
        raise
    print(f"\njoined {GROUP} in {time.monotonic() - t0:.2f} s (NCCL {'.'.join(map(str, group.lib.version))}, "
          f"{so}, trainer cuda:{device}{', same-GPU emulation' if trainer_env else ''})")
    try:
        # perturbed weights, flattened buckets from host memory
        pert = raw_weights(PERT)
        total = sum(len(v[0]) for v in pert.values())
        res = rn.push_weights_nccl(c, pert, "nccl-1", group_name=GROUP, bucket_bytes=64 << 10, timeout=TIMEOUT)
        assert res.posts >= 5, res
        assert res.bytes == total, (res.bytes, total)
        assert res.response.get("success") is True and res.response.get("weight_version") == "nccl-1", res.response
        assert res.response.get("committed") is True, res.response
        assert c.get_weight_version() == "nccl-1"
        check_golden(d, g_pert, "qwen3/perturbed over NCCL (flattened buckets)")
        (out,) = c.generate([1, 2, 3], max_new_tokens=2)
        assert out.weight_version == "nccl-1", out.weight_version
        print(f"flattened push: {res.posts} requests, {res.bytes} bytes, {res.seconds:.3f} s")

        # back to the original weights, one broadcast per tensor, from CUDA tensors
        res = rn.push_weights_nccl(c, cuda_weights(ORIG, device), "nccl-2", group_name=GROUP,
                                   bucket_bytes=256 << 10, flattened=False, timeout=TIMEOUT)
        assert res.response.get("weight_version") == "nccl-2" and res.response.get("committed") is True, res.response
        check_golden(d, g_orig, "qwen3 over NCCL (per tensor)")

        # a refused request: received, discarded, nothing changes, the group stays in step
        before = scores(d, g_orig["prompts"])
        bad = dict(pert)
        bad["model.layers.0.mlp.bogus_proj.weight"] = (memoryview(bytes(64)), "bfloat16", (4, 8))
        with pytest.raises(RolloutdError) as ei:
            rn.push_weights_nccl(c, bad, "nccl-bad", group_name=GROUP, bucket_bytes=1 << 30, timeout=TIMEOUT)
        assert ei.value.status == 400, ei.value
        assert "bogus_proj" in (ei.value.message or "") + str(ei.value.param), ei.value
        assert c.get_weight_version() == "nccl-2"
        assert scores(d, g_orig["prompts"]) == before, "a refused NCCL update changed the served weights"

        res = rn.push_weights_nccl(c, pert, "nccl-3", group_name=GROUP, bucket_bytes=1 << 30, timeout=TIMEOUT)
        assert res.posts == 1 and res.response.get("weight_version") == "nccl-3", res.response
        check_golden(d, g_pert, "qwen3/perturbed over NCCL after a refused request")
    finally:
        if rn.get_group(GROUP) is not None:
            rn.destroy_group(GROUP, timeout=60)

    # the group is gone on both sides
    with pytest.raises(RolloutdError) as ei:
        c.update_weights_from_distributed(names=["model.norm.weight"], dtypes=["bfloat16"], shapes=[[96]],
                                          group_name=GROUP, weight_version="after")
    assert ei.value.status == 400 and GROUP in (ei.value.message or ""), ei.value
    assert c.get_weight_version() == "nccl-3"
    assert c.health()


GROUP_FLEET = "g-e2e-fleet"


@needs_gpu[0]
@needs_gpu[1]
def test_nccl_fleet_push_all_or_none(rolloutd, monkeypatch):
    from rolloutd_client import Fleet, FleetPushError
    from rolloutd_client import nccl as rn
    from rolloutd_client import shm as rshm

    device, daemon_envs, trainer_env = fleet_layout(2)
    ds = [start_with_env(rolloutd, monkeypatch, env, ORIG, *BF16_ARGS) for env in daemon_envs]
    for k, v in trainer_env.items():
        monkeypatch.setenv(k, v)
    fleet = Fleet([d.url for d in ds], timeout=TIMEOUT)
    assert fleet.nccl_ranks() == ([1, 2], 3)
    g_orig, g_pert = golden(ORIG), golden(PERT)
    try:
        group = fleet.init_nccl_group(group_name=GROUP_FLEET, device=device, timeout=TIMEOUT, nccl_so=nccl_so())
    except RolloutdError as e:
        if e.status == 400 and "CUDA build" in (e.message or ""):
            pytest.skip(f"{BIN} is not a CUDA build (make CUDA=1): {e.message}")
        raise
    assert group.world_size == 3 and group.urls == fleet.urls
    seg = None
    try:
        pert = raw_weights(PERT)
        res = fleet.push_weights(pert, "fleet-1", transport="nccl", group_name=GROUP_FLEET, bucket_bytes=64 << 10,
                                 timeout=TIMEOUT)
        assert res.transport == "nccl" and res.weight_version == "fleet-1" and res.rounds >= 3, res
        assert res.bytes == sum(len(v[0]) for v in pert.values()), res
        assert all(r.get("committed") is True for r in res.responses.values()), res.responses
        for d in ds:
            check_golden(d, g_pert, f"qwen3/perturbed over a fleet NCCL group ({d.url})")
        assert fleet.weight_versions() == {d.url: "fleet-1" for d in ds}

        # another writer holds the second daemon's update: it refuses every bucket of the fleet push
        # (409, received and discarded), so the first drops its update and neither changes
        before = [scores(d, g_pert["prompts"]) for d in ds]
        norm = pert["model.norm.weight"]
        seg = rshm.Segment(len(norm[0]))
        seg.buf[:len(norm[0])] = bytes(norm[0])
        other = Client(ds[1].url).update_weights_from_shm(
            seg.name, [{"name": "model.norm.weight", "dtype": "bfloat16", "shape": list(norm[2]), "offset": 0}],
            is_last=False, weight_version="other-writer")
        with pytest.raises(FleetPushError) as ei:
            fleet.push_weights(raw_weights(ORIG), "fleet-bad", transport="nccl", group_name=GROUP_FLEET,
                               bucket_bytes=64 << 10, timeout=TIMEOUT)
        e = ei.value
        assert e.stage == "stage" and e.committed == [], e
        assert getattr(e.errors.get(ds[1].url), "status", None) == 409, e.errors
        assert e.outcomes[ds[0].url] == "its open update was dropped", e.outcomes
        assert e.versions == {d.url: "fleet-1" for d in ds}, e.versions
        assert [scores(d, g_pert["prompts"]) for d in ds] == before, "a refused fleet push changed the weights"
        rshm.abort_update(Client(ds[1].url), "other-writer", TIMEOUT, other["transaction_id"])

        # the group is still in step: back to the original weights, one broadcast per tensor
        assert rn.get_group(GROUP_FLEET) is group
        res = fleet.push_weights(cuda_weights(ORIG, device), "fleet-2", transport="nccl", group_name=GROUP_FLEET,
                                 bucket_bytes=256 << 10, flattened=False, timeout=TIMEOUT)
        assert res.weight_version == "fleet-2", res
        for d in ds:
            check_golden(d, g_orig, f"qwen3 over a fleet NCCL group, per tensor ({d.url})")
    finally:
        if seg is not None:
            seg.close()
        if rn.get_group(GROUP_FLEET) is not None:
            fleet.destroy_nccl_group(GROUP_FLEET)
    assert all(fleet.health().values())


# ------------------------------------------------------------------------------------------------
# an SGLang-style trainer: torch.distributed only, the TCPStore rendezvous, no unique id

def init_custom_process_group(backend, init_method, world_size, rank, group_name, timeout):
    """SGLang's init_custom_process_group (srt/utils), as slime and AReaL copy it."""
    import torch
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    ver = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    opt = "backend_options" if ver >= (2, 6) else "pg_options"
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout, **{opt: None})
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def sglang_push(d, pg, weights, version, device, flattened):
    """POST /update_weights_from_distributed, then dist.broadcast each tensor (or the flattened
    bucket) from rank 0 while the request is in flight, as slime's update_weights_from_distributed."""
    import torch
    import torch.distributed as dist
    names = list(weights)
    tensors = [weights[n].to(f"cuda:{device}").contiguous() for n in names]
    body = {"names": names, "dtypes": [str(t.dtype).replace("torch.", "") for t in tensors],
            "shapes": [list(t.shape) for t in tensors], "group_name": GROUP_SGLANG, "weight_version": version,
            "load_format": "flattened_bucket" if flattened else None, "flush_cache": True}
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(d.post, "/update_weights_from_distributed", body, timeout=TIMEOUT)
        if flattened:  # SGLang's FlattenedTensorBucket: the tensors' bytes, concatenated
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
            dist.broadcast(flat, src=0, group=pg)
        else:
            for t in tensors:
                dist.broadcast(t, src=0, group=pg)
        torch.cuda.synchronize(device)
        return fut.result(timeout=TIMEOUT)


GROUP_SGLANG = "slime-pp_0"


def _torch_backend_available(name):
    import torch.distributed as dist
    if name == "nccl":
        return True
    if name == "nccl2":
        return hasattr(dist, "ProcessGroupNCCL2")
    return name in getattr(dist.Backend, "backend_list", [])


@needs_gpu[0]
@needs_gpu[1]
@pytest.mark.parametrize("backend", ["nccl", "nccl2", "nccl-legacy"])
def test_sglang_trainer_over_tcpstore(rolloutd, monkeypatch, backend):
    """The trainer uses torch.distributed only: init_custom_process_group(init_method="tcp://...")
    while POST /init_weights_update_group (no unique id, master_port as a string) is in flight,
    then per-tensor and flattened broadcasts; the served model must become qwen3/perturbed and back.
    With each NCCL backend the trainer's torch has: "nccl" (torch 2.15's default is nccl2, which
    creates its communicator inside init_custom_process_group and waits there for the daemon to
    join), and "nccl2" and "nccl-legacy" by name where torch registers them (the legacy
    ProcessGroupNCCL publishes its id at the first broadcast). Then, with "nccl", a store that
    closes at once fails the init with a 500 and the daemon keeps serving."""
    import torch
    import torch.distributed as dist
    from rolloutd_client import nccl as rn

    if not _torch_backend_available(backend):
        pytest.skip(f"torch {torch.__version__} has no {backend!r} backend")

    device, daemon_env, trainer_env = layout()
    so = nccl_so()
    ours, theirs = tuple(rn.load_nccl(so).version), torch.cuda.nccl.version()
    if not isinstance(theirs, tuple):  # an NCCL_VERSION_CODE on old torch
        theirs = (theirs // 10000, theirs // 100 % 100, theirs % 100)
    if ours != tuple(theirs):
        pytest.skip(f"torch's NCCL {theirs} is not rolloutd's {ours} ({so}); NCCL needs one release on both sides")
    saved = {k: os.environ.get(k) for k in daemon_env}
    for k, v in daemon_env.items():
        monkeypatch.setenv(k, v)
    d = rolloutd(ORIG, *BF16_ARGS, "--weight-update-timeout", "60")
    for k, v in saved.items():
        if v is None:
            monkeypatch.delenv(k)
        else:
            monkeypatch.setenv(k, v)
    for k, v in trainer_env.items():
        monkeypatch.setenv(k, v)
    torch.cuda.set_device(device)
    # nccl2 binds its communicator to cuda:(LOCAL_RANK or rank) % devices, not the current device;
    # torchrun sets LOCAL_RANK for a real trainer
    monkeypatch.setenv("LOCAL_RANK", str(device))

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    init = {"master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1, "world_size": 2,
            "group_name": GROUP_SGLANG, "backend": "nccl"}
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(d.post, "/init_weights_update_group", init, timeout=TIMEOUT)  # before the store exists
        time.sleep(0.5)
        pg = init_custom_process_group(backend, f"tcp://127.0.0.1:{port}", 2, 0, GROUP_SGLANG,
                                       datetime.timedelta(seconds=TIMEOUT))
        r = fut.result(timeout=TIMEOUT)
    if r.status_code == 400 and "CUDA build" in r.text:
        pytest.skip(f"{BIN} is not a CUDA build (make CUDA=1): {r.text}")
    assert r.status_code == 200, r.text
    try:
        g_orig, g_pert = golden(ORIG), golden(PERT)
        pert = {k: torch.frombuffer(bytearray(mv), dtype=torch.bfloat16).reshape(shape)
                for k, (mv, dt, shape) in raw_weights(PERT).items()}
        r = sglang_push(d, pg, pert, "sglang-1", device, flattened=False)
        assert r.status_code == 200 and r.json()["committed"] is True, r.text
        assert Client(d.url).get_weight_version() == "sglang-1"
        check_golden(d, g_pert, "qwen3/perturbed from an SGLang-style trainer (per tensor)")
        orig = {k: torch.frombuffer(bytearray(mv), dtype=torch.bfloat16).reshape(shape)
                for k, (mv, dt, shape) in raw_weights(ORIG).items()}
        r = sglang_push(d, pg, orig, "sglang-2", device, flattened=True)
        assert r.status_code == 200 and r.json()["committed"] is True, r.text
        check_golden(d, g_orig, "qwen3 from an SGLang-style trainer (flattened bucket)")
    finally:
        d.post("/destroy_weights_update_group", {"group_name": GROUP_SGLANG}, timeout=TIMEOUT)
        dist.destroy_process_group(pg)
    if backend != "nccl":
        return

    # a store that accepts and closes: the init fails at once, naming it; nothing is left behind
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)

    def slam():
        c, _ = ls.accept()
        c.close()
    threading.Thread(target=slam, daemon=True).start()
    t0 = time.monotonic()
    r = d.post("/init_weights_update_group", dict(init, master_port=ls.getsockname()[1], group_name="bad"),
               timeout=TIMEOUT)
    assert r.status_code == 500 and "closed the connection" in r.text, r.text
    assert time.monotonic() - t0 < 30
    ls.close()
    r = d.post("/destroy_weights_update_group", {"group_name": "bad"}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert Client(d.url).get_weight_version() == "sglang-2" and Client(d.url).health()


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--probe-rank":
        sys.exit(_probe_rank(int(sys.argv[2]), sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None))
    print(__doc__)
    sys.exit(2)
