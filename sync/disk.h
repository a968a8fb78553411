/*
 * disk.h — the checkpoint-directory transport: /update_weights_from_disk.
 *
 * Reads a Hugging Face safetensors directory (model.safetensors, or the shards of
 * model.safetensors.index.json) through rs_st_dir_open and runs it as one whole transaction: every
 * tensor whose name is a parameter of the served model is staged, and so are the FP8 KV scales
 * `model.layers.N.self_attn.k_scale` / `v_scale` (taken exactly as an shm push of the same tensors
 * takes them: applied under --kv-scale-mode static, all layers or none), then committed. As at
 * load, names the model does not have (e.g. rotary inv_freq buffers or a tied lm_head) are skipped.
 * Only tensors are read; config.json is not (the served architecture and shapes stay as loaded,
 * and a checkpoint of another shape fails on its first tensor).
 *
 * Path restriction. The route is off unless the daemon was started with --allowed-weight-dir DIR;
 * then model_path must resolve (realpath: "..", symlinked directories) to DIR or a directory below
 * it, and so must every file read (the index and each shard: a symlinked shard pointing outside DIR
 * is refused), each checked before it is opened. A path that does not resolve and one that
 * resolves outside DIR get the same 400, naming neither the target nor errno. A symlink swapped
 * between that check and the read is not guarded against: DIR is meant to be writable only by the
 * trainer and the operator. Files are opened without blocking (a FIFO is refused, not waited on).
 *
 * A checkpoint file the trainer truncates while it is being read (rewriting it in place) fails the
 * update with a 400 instead of killing the daemon with SIGBUS (disk.c); the old weights keep
 * serving.
 */
#ifndef RS_SYNC_DISK_H
#define RS_SYNC_DISK_H

#include <stdbool.h>

#include "sync.h"

/* True when `real` (a realpath) is `dir` (a realpath) or inside it. */
bool rs_disk_path_inside(const char *real, const char *dir);

/* The job (sync service thread). RS_EINVAL (400) with param "model_path" when the route is
 * disabled, the path does not resolve, or it or a file in it escapes allowed-weight-dir, or a file
 * shrank while it was read; RS_ESTATE (409) while a streamed update is open; RS_EBUSY (503) if no
 * SIGBUS guard slot is free; tensor errors as for any transaction. */
int rs_disk_update(rs_sync *s, const rs_disk_update_req *r, rs_sync_result *res, rs_error *err);

/* Tests only: when non-NULL, rs_disk_update calls it on the service thread once the checkpoint in
 * `model_dir` is open (every shard mapped and parsed) and the transaction joined, before the first
 * tensor is read; a test truncates a shard there to reproduce a trainer that rewrites the
 * checkpoint mid-request, deterministically. NULL in the daemon. */
extern void (*rs_disk_test_hook_opened)(const char *model_dir);

#endif /* RS_SYNC_DISK_H */
