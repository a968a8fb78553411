"""Weight push over NCCL broadcast (docs/api.md "Weight updates": /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group).

    from rolloutd_client import Client
    from rolloutd_client import nccl
    c = Client("http://10.0.0.7:30000")
    g = nccl.init_group(c, group_name="g0")                    # trainer = rank 0, rolloutd = rank 1
    nccl.push_weights_nccl(c, model.state_dict(), version="18", group_name="g0")
    nccl.destroy_group(g)

The trainer is NCCL rank 0 and the broadcast root; engine i of `clients` joins from rank 1 + the
ranks of the engines before it (one each for rolloutd; rank_layout), so one broadcast reaches every
engine. rolloutd_client.Fleet builds such a group over a whole fleet and pushes through it with an
all-or-none commit (fleet_push.py). The rendezvous is an ncclUniqueId made here with
ncclGetUniqueId and sent base64-encoded as `nccl_unique_id_b64`, which needs no torch.distributed
on this side. Both sides must join at once: the init POSTs run in the background while this process
joins as rank 0; if a POST fails first, the local join is aborted. (A trainer that already has a
torch.distributed weight-update group, SGLang's init_custom_process_group with init_method
tcp://..., needs none of this module: rolloutd joins that group through the trainer's TCPStore when
the init request carries no nccl_unique_id_b64; sync/nccl.h.)

Each update POSTs names/dtypes/shapes (+ group_name, load_format, weight_version, is_last, and after
the first bucket the transaction_id each engine's answer gave) and broadcasts the bytes while the
POST is in flight:
  - flattened=True (default, SGLang's load_format "flattened_bucket"): the tensors of a bucket are
    concatenated in order, without padding, into one contiguous CUDA buffer (for a BF16 model, one
    BF16 buffer, as SGLang's FlattenedTensorBucket), and broadcast once per bucket;
  - flattened=False (load_format null): one broadcast per tensor, in order.
Every broadcast is ncclUint8 with count = the buffer's bytes (rolloutd receives the same way), and a
0-byte tensor or bucket is not broadcast. POSTs are sent one bucket at a time (the server receives
broadcasts in the order its requests arrive); the last bucket carries is_last: true, so rolloutd
commits the whole update there, or refuses it naming a missing parameter.

Failures. Every wait is bounded (`timeout`) and polls the communicator's asynchronous error and the
POSTs: a refused request (bad name or shape, 409) is still received and discarded by rolloutd, so the
group stays usable and RolloutdError is raised; a transport failure or timeout aborts the local
communicator (ncclCommAbort), and the group must be initialized again. Whatever ends a push after a
bucket was sent (also an exception while packing, or Ctrl-C), each engine that did not refuse it is
then told to drop the update (rolloutd_client.shm.abort_update, over the shm route: an
/update_weights_from_distributed with no names would abort the group), so that the next version is
not refused with 409 until weight-update-timeout.

NCCL rules the caller must keep:
  - both sides must run the same NCCL release (NCCL refuses mismatched versions at init): point
    `nccl_so` (or $ROLLOUTD_NCCL_SO) at the libnccl.so.2 rolloutd links, e.g.
    /usr/local/cuda/lib64/libnccl.so.2; by default "libnccl.so.2" is used (torch's, once torch is
    imported);
  - two ranks may not share one GPU (NCCL fails with "Duplicate GPU detected"): the trainer and
    rolloutd need different GPUs, or different NCCL_HOSTID values with NCCL_P2P_DISABLE=1,
    NCCL_SHM_DISABLE=1 and a socket network (see tests/e2e/test_nccl_gpu.py).

Importing this module needs neither torch, CUDA nor libnccl: they are loaded on first use, with an
error that says what is missing. The NCCL binding follows vLLM's pynccl_wrapper (ctypes over the
library's C API).
"""
import base64
import concurrent.futures as cf
import ctypes
import math
import operator
import os
import socket
import threading
import time

from . import shm as _shm
from . import tensors as _tensors

NCCL_UNIQUE_ID_BYTES = 128
DEFAULT_GROUP = "weight_update_group"   # SGLang's default group_name
_IN_PROGRESS = 7                        # ncclInProgress
_UINT8 = 1                              # ncclUint8
_CONFIG_MAGIC = 0xCAFEBEEF
_CONFIG_UNDEF_INT = -2147483648         # NCCL_CONFIG_UNDEF_INT (INT_MIN)


def _nccl_version_code(major, minor, patch):
    return major * 10000 + minor * 100 + patch if (major, minor) >= (2, 9) else major * 1000 + minor * 100 + patch


class NcclError(RuntimeError):
    """An NCCL or CUDA failure on the trainer's side (the local communicator was aborted)."""


# ------------------------------------------------------------------------------------------------
# ctypes binding (loaded lazily)

class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


class ncclConfig_t(ctypes.Structure):
    """The leading fields of ncclConfig_t, as of NCCL 2.14 (`version` says so): NCCL copies `size`
    bytes and gives every field a later version added its default, so this works with any
    library >= 2.14."""
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int),
                ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p), ("splitShare", ctypes.c_int)]


_comm_t = ctypes.c_void_p
_stream_t = ctypes.c_void_p
_result_t = ctypes.c_int

_FUNCS = [
    ("ncclGetErrorString", ctypes.c_char_p, [_result_t]),
    ("ncclGetVersion", _result_t, [ctypes.POINTER(ctypes.c_int)]),
    ("ncclGetUniqueId", _result_t, [ctypes.POINTER(ncclUniqueId)]),
    ("ncclCommInitRankConfig", _result_t,
     [ctypes.POINTER(_comm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int, ctypes.POINTER(ncclConfig_t)]),
    ("ncclCommGetAsyncError", _result_t, [_comm_t, ctypes.POINTER(_result_t)]),
    ("ncclBroadcast", _result_t,
     [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _comm_t, _stream_t]),
    ("ncclCommFinalize", _result_t, [_comm_t]),
    ("ncclCommDestroy", _result_t, [_comm_t]),
    ("ncclCommAbort", _result_t, [_comm_t]),
]

_lib_lock = threading.Lock()
_libs = {}


class _Nccl:
    """libnccl.so.2 through ctypes; `so` is a path or a soname."""

    def __init__(self, so):
        try:
            lib = ctypes.CDLL(so)
        except OSError as e:
            raise NcclError(
                f"cannot load the NCCL library {so!r} ({e}); install NCCL >= 2.14 or point nccl_so= / "
                f"$ROLLOUTD_NCCL_SO at the libnccl.so.2 that rolloutd links") from None
        self.so = so
        self.f = {}
        for name, restype, argtypes in _FUNCS:
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise NcclError(f"{so}: no {name}; NCCL >= 2.14 is needed (non-blocking communicators)") from None
            fn.restype, fn.argtypes = restype, argtypes
            self.f[name] = fn
        try:
            last = lib.ncclGetLastError
            last.restype, last.argtypes = ctypes.c_char_p, [_comm_t]
            self.f["ncclGetLastError"] = last
        except AttributeError:
            pass
        v = ctypes.c_int()
        self.check(self.f["ncclGetVersion"](ctypes.byref(v)), "ncclGetVersion")
        self.version_code = v.value
        code = v.value
        self.version = (code // 10000, code // 100 % 100, code % 100) if code >= 20900 else \
            (code // 1000, code // 100 % 10, code % 100)
        if self.version < (2, 14, 0):
            raise NcclError(f"{so} is NCCL {'.'.join(map(str, self.version))}; >= 2.14 is needed")

    def error(self, r, what, comm=None):
        msg = self.f["ncclGetErrorString"](r)
        msg = msg.decode(errors="replace") if msg else f"error {r}"
        detail = ""
        if "ncclGetLastError" in self.f:
            d = self.f["ncclGetLastError"](comm)
            detail = d.decode(errors="replace") if d else ""
        return NcclError(f"{what}: NCCL {msg}" + (f": {detail}" if detail else ""))

    def check(self, r, what, comm=None):
        if r != 0 and r != _IN_PROGRESS:
            raise self.error(r, what, comm)
        return r

    def async_state(self, comm, what):
        st = _result_t()
        self.check(self.f["ncclCommGetAsyncError"](comm, ctypes.byref(st)), "ncclCommGetAsyncError", comm)
        if st.value != 0 and st.value != _IN_PROGRESS:
            raise self.error(st.value, what, comm)
        return st.value


def load_nccl(so=None):
    """The NCCL binding for library `so` (default $ROLLOUTD_NCCL_SO, else "libnccl.so.2"); cached."""
    so = so or os.environ.get("ROLLOUTD_NCCL_SO") or "libnccl.so.2"
    with _lib_lock:
        if so not in _libs:
            _libs[so] = _Nccl(so)
        return _libs[so]


def _torch():
    try:
        import torch
    except ImportError:
        raise NcclError("NCCL weight pushes need PyTorch with CUDA (pip install torch)") from None
    if not torch.cuda.is_available():
        raise NcclError("NCCL weight pushes need a CUDA device; torch.cuda.is_available() is False")
    return torch


def _sleep(spin):
    time.sleep(0.00002 if spin < 2000 else 0.001)


# ------------------------------------------------------------------------------------------------
# groups

_groups_lock = threading.Lock()
_groups = {}                            # group_name -> NcclGroup


class NcclGroup:
    """This process's side (rank 0) of one weights update group. Use init_group to make one."""

    def __init__(self, lib, comm, clients, group_name, world_size, device, timeout):
        self.lib, self.comm, self.clients = lib, comm, list(clients)
        self.group_name, self.world_size, self.device = group_name, world_size, device
        self.timeout = timeout
        self.aborted = False
        torch = _torch()
        self.stream = torch.cuda.Stream(device=device)

    @property
    def urls(self):
        return [c.url for c in self.clients]

    def abort(self):
        """Aborts the communicator (kernels stop); the group is unusable afterwards."""
        if self.comm is not None and not self.aborted:
            self.aborted = True
            self.lib.f["ncclCommAbort"](self.comm)
            self.comm = None
        with _groups_lock:
            if _groups.get(self.group_name) is self:
                del _groups[self.group_name]

    def _wait_enqueued(self, what, deadline, futures=()):
        spin = 0
        while self.lib.async_state(self.comm, what) == _IN_PROGRESS:
            _raise_failed(futures)
            if time.monotonic() > deadline:
                raise NcclError(f"{what}: no progress within the timeout")
            _sleep(spin)
            spin += 1

    def broadcast(self, buf, futures=(), timeout=None):
        """Broadcasts the bytes of CUDA tensor `buf` (contiguous, on this group's device) from rank
        0 and waits until they have left, polling NCCL's asynchronous error and `futures` (POSTs
        that may fail first). Aborts the group on any failure or at the timeout."""
        torch = _torch()
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if self.comm is None:
            raise NcclError(f"weights update group '{self.group_name}' was aborted; init a new one")
        nbytes = buf.numel() * buf.element_size()
        if nbytes == 0:
            return
        try:
            ptr = ctypes.c_void_p(buf.data_ptr())
            r = self.lib.f["ncclBroadcast"](ptr, ptr, nbytes, _UINT8, 0, self.comm,
                                            ctypes.c_void_p(self.stream.cuda_stream))
            self.lib.check(r, "ncclBroadcast", self.comm)
            self._wait_enqueued("ncclBroadcast", deadline, futures)
            ev = torch.cuda.Event()
            ev.record(self.stream)
            spin = 0
            while not ev.query():
                self.lib.async_state(self.comm, "ncclBroadcast")
                _raise_failed(futures)
                if time.monotonic() > deadline:
                    raise NcclError(f"broadcast of {nbytes} bytes did not complete within {timeout:.0f} s "
                                    f"(a rank of group '{self.group_name}' is not receiving)")
                _sleep(spin)
                spin += 1
        except BaseException:
            self.abort()
            raise


def _raise_failed(futures):
    """Raises the exception of the first finished future that failed (a refused POST)."""
    for f in futures:
        if f.done() and f.exception() is not None:
            raise f.exception()


def _post_all(pool, clients, path, bodies, timeout):
    return [pool.submit(c.post, path, b, timeout) for c, b in zip(clients, bodies)]


def new_unique_id(lib):
    """(ncclUniqueId, its base64). The calling process hosts the group's bootstrap root from now
    on, so it must stay alive until every rank has joined."""
    uid = ncclUniqueId()
    lib.check(lib.f["ncclGetUniqueId"](ctypes.byref(uid)), "ncclGetUniqueId")
    raw = ctypes.string_at(ctypes.addressof(uid), NCCL_UNIQUE_ID_BYTES)
    return uid, base64.b64encode(raw).decode("ascii")


def unique_id_from_b64(b64):
    raw = base64.b64decode(b64, validate=True)
    if len(raw) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"an ncclUniqueId is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    uid = ncclUniqueId()
    ctypes.memmove(ctypes.addressof(uid), raw, NCCL_UNIQUE_ID_BYTES)
    return uid


def join_comm(lib, uid, world_size, rank, timeout, futures=(), what="NCCL group"):
    """Joins as `rank` of `world_size` on the current CUDA device with a non-blocking
    ncclCommInitRankConfig, polled until every rank has joined; aborts and raises when a future in
    `futures` fails first (a refused POST), on an NCCL error, or after `timeout` seconds
    (TimeoutError). Returns the communicator handle."""
    cfg = ncclConfig_t(size=ctypes.sizeof(ncclConfig_t), magic=_CONFIG_MAGIC,
                       version=_nccl_version_code(2, 14, 0), blocking=0, cgaClusterSize=_CONFIG_UNDEF_INT,
                       minCTAs=_CONFIG_UNDEF_INT, maxCTAs=_CONFIG_UNDEF_INT, netName=None,
                       splitShare=_CONFIG_UNDEF_INT)
    comm = _comm_t()
    deadline = time.monotonic() + timeout
    r = lib.f["ncclCommInitRankConfig"](ctypes.byref(comm), world_size, uid, rank, ctypes.byref(cfg))
    try:
        lib.check(r, "ncclCommInitRankConfig", comm)
        spin = 0
        while lib.async_state(comm, "ncclCommInitRankConfig") == _IN_PROGRESS:
            _raise_failed(futures)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: the other ranks did not join within {timeout:.0f} s")
            _sleep(spin)
            spin += 1
    except BaseException:
        if comm.value:
            lib.f["ncclCommAbort"](comm)
        raise
    return comm


def get_group(group_name=DEFAULT_GROUP):
    """The group this process initialized under `group_name`, or None."""
    with _groups_lock:
        return _groups.get(group_name)


def rank_layout(ranks_per_client):
    """(rank_offsets, world_size) of a group in which the trainer is rank 0 and client i joins
    ranks_per_client[i] ranks from rank_offsets[i] on: rank_offset = 1 + the ranks of the clients
    before it, world_size = 1 + all of them (SGLang's convention: a server with tp_size N joins as
    rank_offset + tp_rank; rolloutd joins one rank)."""
    ranks = [operator.index(r) for r in ranks_per_client]
    if not ranks:
        raise ValueError("a weights update group needs at least one server")
    if any(r < 1 for r in ranks):
        raise ValueError(f"every server joins at least one rank, got ranks_per_client={ranks}")
    offsets, nxt = [], 1
    for r in ranks:
        offsets.append(nxt)
        nxt += r
    return offsets, nxt


def group_bodies(n_clients, group_name, uid_b64, master_address, master_port, ranks_per_client=None):
    """The /init_weights_update_group body for each of n_clients servers (ranks_per_client: an int
    for all, a list, or None for one each; rank_layout)."""
    if ranks_per_client is None or isinstance(ranks_per_client, int):
        ranks_per_client = [1 if ranks_per_client is None else ranks_per_client] * n_clients
    if len(ranks_per_client) != n_clients:
        raise ValueError(f"ranks_per_client has {len(ranks_per_client)} entries for {n_clients} servers")
    offsets, world_size = rank_layout(ranks_per_client)
    return [{"master_address": master_address, "master_port": int(master_port), "rank_offset": off,
             "world_size": world_size, "group_name": group_name, "backend": "nccl", "nccl_unique_id_b64": uid_b64}
            for off in offsets]


def init_group(clients, group_name=DEFAULT_GROUP, device=None, timeout=300.0, nccl_so=None,
               master_address=None, master_port=29500, ranks_per_client=None):
    """Creates weights update group `group_name` with this process as rank 0 and each of
    `clients` (a Client or a list) joining in order after it; returns the NcclGroup (also found
    later by get_group / push_weights_nccl under its name).

    ranks_per_client: how many ranks each server joins (an int for all, or a list; default one
    each, which is what a rolloutd daemon joins): server i is sent rank_offset = 1 + the ranks of
    the servers before it and world_size = 1 + all of them (rank_layout).
    device: the CUDA device the trainer broadcasts from (default torch.cuda.current_device()).
    master_address / master_port are sent for SGLang's request shape only: the rendezvous is the
    unique id, which carries this process's bootstrap address (chosen by NCCL, see
    NCCL_SOCKET_IFNAME). Raises RolloutdError when a server refuses, NcclError on NCCL failures,
    TimeoutError when the ranks do not all join within `timeout` seconds."""
    clients = list(clients) if isinstance(clients, (list, tuple)) else [clients]
    if not clients:
        raise ValueError("init_group needs at least one rolloutd client")
    if get_group(group_name) is not None:
        raise ValueError(f"group {group_name!r} already exists in this process; destroy_group it first")
    torch = _torch()
    lib = load_nccl(nccl_so)
    device = torch.cuda.current_device() if device is None else int(device)
    torch.cuda.set_device(device)

    uid, uid_b64 = new_unique_id(lib)
    bodies = group_bodies(len(clients), group_name, uid_b64, master_address or socket.gethostname() or "127.0.0.1",
                          master_port, ranks_per_client)
    world_size = bodies[0]["world_size"]
    pool = cf.ThreadPoolExecutor(max_workers=len(clients), thread_name_prefix="rolloutd-nccl-init")
    deadline = time.monotonic() + timeout
    try:
        futures = _post_all(pool, clients, "/init_weights_update_group", bodies, timeout + 30)
        comm = join_comm(lib, uid, world_size, 0, timeout, futures, what=f"NCCL group {group_name!r}")
        try:
            for f in futures:  # every server answers once it has joined
                f.result(timeout=max(1.0, deadline - time.monotonic() + 30))
        except BaseException:
            lib.f["ncclCommAbort"](comm)
            raise
    finally:
        pool.shutdown(wait=False)
    g = NcclGroup(lib, comm, clients, group_name, world_size, device, timeout)
    with _groups_lock:
        _groups[group_name] = g
    return g


def destroy_group(group, timeout=60.0):
    """Leaves the group on both sides: POSTs /destroy_weights_update_group to every engine while
    finalizing the local communicator (aborted if that does not end within `timeout`). Accepts an
    NcclGroup or a group name. Raises the first server refusal after the local side is gone."""
    if isinstance(group, str):
        name = group
        group = get_group(name)
        if group is None:
            raise ValueError(f"no NCCL group {name!r} in this process")
    lib = group.lib
    pool = cf.ThreadPoolExecutor(max_workers=len(group.clients), thread_name_prefix="rolloutd-nccl-destroy")
    try:
        futures = _post_all(pool, group.clients, "/destroy_weights_update_group",
                            [{"group_name": group.group_name}] * len(group.clients), timeout + 30)
        if group.comm is not None and not group.aborted:
            deadline = time.monotonic() + timeout
            try:
                lib.check(lib.f["ncclCommFinalize"](group.comm), "ncclCommFinalize", group.comm)
                spin = 0
                while lib.async_state(group.comm, "ncclCommFinalize") == _IN_PROGRESS:
                    if time.monotonic() > deadline:
                        raise TimeoutError("ncclCommFinalize did not finish")
                    _sleep(spin)
                    spin += 1
                lib.check(lib.f["ncclCommDestroy"](group.comm), "ncclCommDestroy")
                group.comm = None
            except (NcclError, TimeoutError):
                pass
            finally:
                group.abort()  # no-op when destroyed; unregisters the group
        else:
            group.abort()
        for f in futures:
            f.result()
    finally:
        pool.shutdown(wait=False)


# ------------------------------------------------------------------------------------------------
# the push

def _as_device_bytes(torch, e, device):
    """Entry e's bytes as a flat uint8 tensor (a view of a CUDA torch tensor where possible, else
    a copy made through pinned host memory)."""
    if getattr(e, "_kind", None) == "torch":
        t = e._obj.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        return t.reshape(-1).view(torch.uint8)
    host = torch.empty(e.nbytes, dtype=torch.uint8, pin_memory=True)
    if e.nbytes:
        e.write_into(host.numpy())
    return host


def plan_buckets(entries, bucket_bytes):
    """Lists of entries, in order, one per request: greedy buckets of <= bucket_bytes, a larger
    tensor alone (flattened: one broadcast per bucket; else one per tensor)."""
    out, cur, used = [], [], 0
    for e in entries:
        if cur and used + e.nbytes > bucket_bytes:
            out.append(cur)
            cur, used = [], 0
        cur.append(e)
        used += e.nbytes
    if cur:
        out.append(cur)
    return out


def bucket_body(items, group_name, flattened, version, is_last):
    """The /update_weights_from_distributed body of one bucket of entries (the transaction_id of
    each engine's update is added per engine)."""
    return {"names": [e.name for e in items], "dtypes": [e.dtype for e in items],
            "shapes": [list(e.shape) for e in items], "group_name": group_name,
            "load_format": "flattened_bucket" if flattened else None,
            "weight_version": str(version), "is_last": bool(is_last)}


def bucket_sends(torch, group, items, flattened, dev):
    """The CUDA buffers the broadcasts of one bucket send, made on the group's stream: flattened,
    one uint8 buffer of every tensor of `items` concatenated in order without padding; else one per
    tensor."""
    with torch.cuda.stream(group.stream):
        if not flattened:
            return [_as_device_bytes(torch, e, dev).to(dev) for e in items]
        buf = torch.empty(sum(e.nbytes for e in items), dtype=torch.uint8, device=dev)
        off = 0
        for e in items:
            if e.nbytes:
                buf[off:off + e.nbytes].copy_(_as_device_bytes(torch, e, dev))
            off += e.nbytes
        return [buf]


_ABORT_WAIT_S = 30.0


def _abort_open_updates(clients, version, futures, timeout, txn_ids=None):
    """After a failed push: once each engine's POST in flight (`futures`, one per engine, of the
    last bucket sent) has returned, or after `timeout` seconds (rolloutd runs weight requests in
    arrival order, so a later one still comes after it), end every engine's open update to
    `version` in parallel, except where the engine refused the bucket (it dropped the update)."""
    deadline = time.monotonic() + timeout
    refused = set()
    for k, f in enumerate(futures):
        try:
            f.result(timeout=max(0.0, deadline - time.monotonic()))
        except cf.TimeoutError:
            pass
        except Exception as e:  # noqa: BLE001 -- only whether it is a refusal matters here
            if _shm._refused(e):
                refused.add(k)
    targets = [k for k in range(len(clients)) if k not in refused]
    if not targets:
        return
    ex = cf.ThreadPoolExecutor(max_workers=len(targets), thread_name_prefix="rolloutd-nccl-abort")
    try:
        cf.wait([ex.submit(_shm.abort_update, clients[k], version, timeout, txn_ids[k] if txn_ids else None)
                 for k in targets], timeout=timeout + 5)
    finally:
        ex.shutdown(wait=False)


def push_weights_nccl(client, state_dict, version, group_name=DEFAULT_GROUP, bucket_bytes=512 << 20,
                      fp8=False, fp8_filter=None, timeout=None, flattened=True, group=None, device=None,
                      nccl_so=None, init_timeout=300.0):
    """Pushes a full model (every parameter, HF names) as weight version `version` over NCCL.

    The group: `group`, else the one init_group made under `group_name`, else a new one with
    `client` as rank 1 (init_group(client, group_name, device, init_timeout, nccl_so)). Every
    engine of the group gets every request. state_dict values as for Client.push_weights (torch
    tensors on any device, numpy arrays, (bytes, dtype, shape)); fp8=True sends the eligible
    matrices as float8_e4m3fn + `<name>_scale_inv` (rolloutd_client.fp8). Buckets hold up to
    bucket_bytes (a larger tensor goes alone); flattened=False broadcasts tensor by tensor.
    Returns rolloutd_client.PushResult (transport "nccl")."""
    from .client import PushResult

    torch = _torch()
    if group is None:
        group = get_group(group_name)
    if group is None:
        group = init_group(client, group_name=group_name, device=device, timeout=init_timeout, nccl_so=nccl_so)
    if client is not None and client.url not in group.urls:
        raise ValueError(f"{client.url} is not in NCCL group {group.group_name!r} ({group.urls})")
    op_timeout = group.timeout if timeout is None else float(timeout)
    ents = _tensors.entries(state_dict, fp8=fp8, fp8_filter=fp8_filter)
    if not ents:
        raise ValueError("state_dict is empty")
    buckets = plan_buckets(ents, int(bucket_bytes))
    dev = torch.device("cuda", group.device)
    t0 = time.perf_counter()
    total, server_s, final = 0, 0.0, None
    pool = cf.ThreadPoolExecutor(max_workers=len(group.clients), thread_name_prefix="rolloutd-nccl-post")
    futures, posted, ok = [], False, False
    txn_ids = [None] * len(group.clients)
    try:
        with torch.cuda.device(group.device):
            group.stream.wait_stream(torch.cuda.current_stream(group.device))
            for i, items in enumerate(buckets):
                body = bucket_body(items, group.group_name, flattened, version, i == len(buckets) - 1)
                nbytes = sum(e.nbytes for e in items)
                sends = bucket_sends(torch, group, items, flattened, dev)
                futures = _post_all(pool, group.clients, "/update_weights_from_distributed",
                                    [dict(body, transaction_id=t) if t else body for t in txn_ids], op_timeout + 60)
                posted = True
                try:
                    for s in sends:
                        group.broadcast(s, futures, op_timeout)
                except BaseException as exc:
                    for f in futures:  # a server's answer says more than the broadcast's failure
                        try:
                            f.result(timeout=5)
                        except cf.TimeoutError:
                            continue
                        except Exception as e:  # noqa: BLE001
                            if e is not exc:
                                raise e from exc
                    raise
                for k, f in enumerate(futures):
                    final = f.result()
                    server_s += float(final.get("seconds") or 0.0)
                    txn_ids[k] = final.get("transaction_id")  # each engine's own update
                total += nbytes
                del sends
        ok = True
    finally:
        try:
            if not ok and posted:
                _abort_open_updates(group.clients, version, futures, min(op_timeout, _ABORT_WAIT_S), txn_ids)
        finally:
            pool.shutdown(wait=False)
    secs = time.perf_counter() - t0
    return PushResult(response=final, bytes=total, seconds=secs,
                      gb_per_s=total / secs / 1e9 if secs > 0 else math.inf, posts=len(buckets),
                      server_seconds=server_s, transport="nccl")


__all__ = ["NcclError", "NcclGroup", "init_group", "destroy_group", "get_group", "push_weights_nccl",
           "load_nccl", "new_unique_id", "unique_id_from_b64", "join_comm", "plan_buckets", "DEFAULT_GROUP",
           "rank_layout", "group_bodies", "bucket_body", "bucket_sends"]
