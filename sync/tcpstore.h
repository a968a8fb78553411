/*
 * tcpstore.h — the client side of torch.distributed's TCPStore, and the c10d key sequence an
 * SGLang-style server runs through it to join a trainer's NCCL group (sync/nccl.h).
 *
 * Why. SGLang-driven trainers (slime, AReaL, veRL's SGLang server mode) create their weight-update
 * group with SGLang's init_custom_process_group(init_method="tcp://addr:port", rank=0): rank 0 hosts
 * a c10d TCPStore, every rank wraps it in PrefixStore(group_name), and ProcessGroupNCCL exchanges
 * the ncclUniqueId through that store. rolloutd joins such a group as a plain store client.
 *
 * The wire protocol (little-endian, what torch's own client sends; verified below). A request is
 * one query-type byte and its arguments; a string or byte vector is a uint64 length and the bytes:
 *   VALIDATE 0    uint32 magic 0x3C85F7CE                           no reply
 *   SET 1         key, value                                        no reply
 *   COMPARE_SET 2 key, expected, desired                            value now stored (see below)
 *   GET 3         key                                               value
 *   ADD 4         key, int64 delta                                  int64 new value
 *   CHECK 5       uint64 n, n keys                                  uint8 0 all set, 1 not all
 *   WAIT 6        uint64 n, n keys                                  uint8 0 once all are set
 *   MULTI_GET 10  uint64 n, n keys                                  n values
 *   MULTI_SET 11  uint64 n, n (key, value)                          no reply
 *   CANCEL_WAIT 12                                                  uint8 1 (after a 0 if the wait
 *                                                                   had just ended)
 *   PING 13       uint32 nonce (the pid)                            uint32 the same nonce
 * A connection starts with VALIDATE and PING. The public store API prefixes every key with "/"
 * (torch's TCPStore keyPrefix_), and so do the rs_tcpstore_* calls here; GET and MULTI_GET are
 * preceded by a WAIT for their keys, as torch's client does (a GET of a missing key is an error
 * on the server). COMPARE_SET answers the stored value after the swap, or `expected` when the key
 * is missing and `expected` is not empty.
 *
 * Joining (what TCPStore(host, port, world_size, is_master=False) + PrefixStore + ProcessGroupNCCL
 * do on a rank > 0; rs_c10d_join, rs_c10d_nccl_unique_id):
 *   1. connect, VALIDATE, PING;
 *   2. ADD "init/" 1 — the raw key, without "/": TCPStore's waitForWorkers; the trainer's store
 *      constructor (rank 0) does not return until world_size ranks have added it;
 *   3. the ncclUniqueId: 128 raw bytes that rank 0 SETs, the first time the group runs a
 *      collective (ProcessGroupNCCL is lazy unless the group is created with a device_id), under
 *      str(ncclCommCounter_) = "0" in the store _new_process_group_helper hands the backend:
 *      PrefixStore("cuda/", PrefixStore(group_name + "/", PrefixStore(group_name, store))), and a
 *      PrefixStore joins prefix + "/" + key, so the wire key is "/G/G//cuda//0" for group G. Other
 *      ranks WAIT for it and GET it (broadcastUniqueNCCLID).
 * No store-based barrier runs: init_custom_process_group calls _new_process_group_helper, not
 * init_process_group, and ProcessGroupNCCL's _set_sequence_number_for_group is a no-op.
 *
 * Versions verified. The bytes torch's own Python client sends for every call above, and the
 * store traffic of a real init_custom_process_group-style gloo group (keys "/G/G//cpu//..."), were
 * recorded through a proxy on torch 2.7.1, 2.8.0, 2.9.1 (the versions SGLang 0.5.x, slime's images
 * and AReaL 1.0 pin) and 2.15.0; this client's bytes match them on each (tests/e2e/
 * test_tcpstore.py does the comparison and runs against both store servers, libuv and the classic
 * one). No difference between these versions in any of it. The ProcessGroupNCCL key ("0" under
 * "cuda/") is read from broadcastUniqueNCCLID and _new_process_group_helper; a CPU machine cannot
 * create a ProcessGroupNCCL, so that key is exercised from the trainer's side with torch's own
 * PrefixStore API. torch's nccl2 backend (the default "nccl" of torch 2.15 unless
 * TORCH_DIST_USE_NCCL2=0) exchanges the id under another key, and as the group is created:
 * rs_c10d_id_flavor below; its key is exercised the same way (the trainer side through torch
 * 2.15.0's PrefixStore). Not covered: groups of more than TORCH_NCCL_RANKS_PER_ROOT (default 128)
 * ranks, for which ProcessGroupNCCL gathers several ids.
 *
 * Bounds. Every call takes an absolute deadline (rs_now_s() clock) that covers all of its reads
 * and writes; the socket is non-blocking and every wait is a poll() up to that deadline, so a
 * peer that stalls costs at most the deadline. A wait that times out sends CANCEL_WAIT and reads
 * its answer for at most RS_TCPSTORE_CANCEL_GRACE_S more, which keeps the connection usable.
 * Every length read from the peer is checked against the caller's buffer before a byte of it is
 * read: a value larger than the buffer is a malformed reply, so nothing here allocates what a
 * peer asks for. After any other failure the connection is unusable and every later call fails at
 * once; close it.
 *
 * Errors: RS_EBUSY (503) when the deadline passes (connection refused until then included),
 * RS_EIO (500) when the peer closes, the socket fails or a reply is malformed, RS_EINVAL (400,
 * param "master_address") for a host that does not resolve; the message names the store, the call
 * and, for a wait, the keys. A host name is looked up within the same deadline (RS_EBUSY, param
 * "master_address", when the name server has not answered by then).
 *
 * Threads: one rs_tcpstore is used by one thread at a time.
 */
#ifndef RS_SYNC_TCPSTORE_H
#define RS_SYNC_TCPSTORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/rs.h"

#define RS_TCPSTORE_KEY_MAX 4096            /* bytes of a key sent, "/" prefix included */
#define RS_TCPSTORE_VALUE_MAX (1 << 20)     /* bytes of a value sent */
#define RS_TCPSTORE_MULTI_MAX 64            /* keys in one CHECK, WAIT, MULTI_GET or MULTI_SET */
#define RS_TCPSTORE_CANCEL_GRACE_S 1.0
#define RS_TCPSTORE_MAGIC 0x3C85F7CEu       /* c10d::detail::validationMagicNumber */
#define RS_C10D_UNIQUE_ID_BYTES 128         /* sizeof(ncclUniqueId) */

typedef struct rs_tcpstore rs_tcpstore;

/* Connects to the store at host:port (a name, an IPv4 or an IPv6 address, brackets allowed) and
 * validates the connection (VALIDATE, PING). A refused or failed connect is retried with back-off
 * until the deadline, since the trainer may create its store after asking rolloutd to join. */
int rs_tcpstore_connect(rs_tcpstore **out, const char *host, int port, double deadline, rs_error *err);
void rs_tcpstore_close(rs_tcpstore *s); /* NULL is a no-op */
/* Called on the resolver thread before a name (not a numeric address) is looked up; tests set it
 * to stand in for a name server that is slow to answer. */
extern void (*rs_tcpstore_test_hook_resolving)(const char *name);
/* Shuts the connection down from any thread: a call waiting on it returns at once (RS_EIO: the
 * store closed the connection), and so does every later call. For stopping a thread that waits on
 * the store; close the connection as usual once that thread is done. NULL is a no-op. */
void rs_tcpstore_interrupt(rs_tcpstore *s);
const char *rs_tcpstore_peer(const rs_tcpstore *s); /* "host:port", for messages */

/* The store API. Keys are the store-level names (torch's store.set("k") is key "k" here); values
 * are bytes. get/compare_set/multi_get write into caller buffers of `cap` bytes and set *n to the
 * value's length. */
int rs_tcpstore_set(rs_tcpstore *s, const char *key, const void *value, size_t n, double deadline, rs_error *err);
int rs_tcpstore_get(rs_tcpstore *s, const char *key, void *buf, size_t cap, size_t *n, double deadline,
                    rs_error *err);
int rs_tcpstore_add(rs_tcpstore *s, const char *key, int64_t delta, int64_t *value, double deadline, rs_error *err);
int rs_tcpstore_check(rs_tcpstore *s, const char *const *keys, int n_keys, bool *all_set, double deadline,
                      rs_error *err);
/* Waits until every key is set: RS_EBUSY at the deadline (after cancelling the wait). */
int rs_tcpstore_wait(rs_tcpstore *s, const char *const *keys, int n_keys, double deadline, rs_error *err);
int rs_tcpstore_compare_set(rs_tcpstore *s, const char *key, const void *expected, size_t expected_n,
                            const void *desired, size_t desired_n, void *buf, size_t cap, size_t *n, double deadline,
                            rs_error *err);
int rs_tcpstore_multi_set(rs_tcpstore *s, const char *const *keys, const void *const *values, const size_t *lens,
                          int n_keys, double deadline, rs_error *err);
int rs_tcpstore_multi_get(rs_tcpstore *s, const char *const *keys, int n_keys, void *const *bufs,
                          const size_t *caps, size_t *lens, double deadline, rs_error *err);

/* ---- the c10d group sequence (above) ---- */

/* The store-level key of `key` in the store ProcessGroupNCCL gets for group_name on `device`
 * ("cuda"): group_name + "/" + group_name + "//" + device + "//" + key. RS_EINVAL if it does not
 * fit in cap bytes. */
int rs_c10d_backend_key(char *out, size_t cap, const char *group_name, const char *device, const char *key);

/* Steps 1-2 as a rank > 0: connect and add this rank to "init/". *joined (may be NULL) gets the
 * count after the add, the ranks that have connected so far. */
int rs_c10d_join(rs_tcpstore **out, const char *host, int port, int64_t *joined, double deadline, rs_error *err);

/* Step 3: waits for and reads the ncclUniqueId of the group's communicator number comm_index (0
 * for the first) into id. A value of another size is a malformed reply (RS_EIO). */
int rs_c10d_nccl_unique_id(rs_tcpstore *s, const char *group_name, uint64_t comm_index,
                           uint8_t id[RS_C10D_UNIQUE_ID_BYTES], double deadline, rs_error *err);

/* Where rank 0 publishes the id of the group's first communicator, by torch's NCCL backend:
 *   RS_C10D_ID_LEGACY  ProcessGroupNCCL: key "0" of the backend store (rs_c10d_nccl_unique_id), set
 *                      at the group's first collective (or as the group is created, with device_id);
 *   RS_C10D_ID_NCCL2   torch's nccl2 backend (c10d::nccl2, what "nccl" means from torch 2.15 unless
 *                      TORCH_DIST_USE_NCCL2=0): NCCLBootstrap::exchangeUniqueId wraps the backend
 *                      store in PrefixStore(group_name) and sets "nccl_storekey_<generation>",
 *                      generation 0 for the group's communicator, which its constructor creates; so
 *                      the store-level key is G/G//cuda//G/nccl_storekey_0. Read from torch 2.15.0's
 *                      distributed_c10d.py (_create_nccl2_process_group: group_name = the group's
 *                      name, store = the "cuda/" backend store) and the nccl2 sources. */
typedef enum { RS_C10D_ID_LEGACY = 0, RS_C10D_ID_NCCL2 = 1 } rs_c10d_id_flavor;

/* The store-level key of that id for group_name. RS_EINVAL if it does not fit in cap bytes. */
int rs_c10d_nccl_id_key(char *out, size_t cap, const char *group_name, rs_c10d_id_flavor flavor);
const char *rs_c10d_id_flavor_name(rs_c10d_id_flavor flavor); /* "ProcessGroupNCCL", "nccl2" */

/* Polls the store (a CHECK of each key, every RS_C10D_POLL_FAST_S for the first
 * RS_C10D_POLL_FAST_FOR_S of the call, then every RS_C10D_POLL_SLOW_S) until the id of either flavor
 * is set, then reads it into id and its flavor into *flavor. Each store call is bounded by
 * op_timeout_s (a stalled store fails like any other); the whole wait by `deadline` (INFINITY:
 * none) and by *cancel (may be NULL; read atomically between polls): RS_EBUSY for either, naming
 * both keys at the deadline. A value of another size is RS_EIO, as for rs_c10d_nccl_unique_id.
 * The schedule: an nccl2 trainer publishes the id as it creates the group, which it does right
 * after the rendezvous, and waits in ncclCommInitRank for this rank meanwhile; a ProcessGroupNCCL
 * trainer publishes it at its first broadcast, maybe an optimizer step later, and waits the same
 * way, at most one slow poll. */
#define RS_C10D_POLL_FAST_S 0.02
#define RS_C10D_POLL_FAST_FOR_S 30.0
#define RS_C10D_POLL_SLOW_S 0.2
int rs_c10d_nccl_unique_id_either(rs_tcpstore *s, const char *group_name, uint8_t id[RS_C10D_UNIQUE_ID_BYTES],
                                  rs_c10d_id_flavor *flavor, double deadline, double op_timeout_s,
                                  const volatile int *cancel, rs_error *err);

#endif /* RS_SYNC_TCPSTORE_H */
