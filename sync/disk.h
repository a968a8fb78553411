/*
 * disk.h — the checkpoint-directory transport: /update_weights_from_disk.
 *
 * Reads a Hugging Face safetensors directory (model.safetensors, or the shards of
 * model.safetensors.index.json) through rs_st_dir_open and runs it as one whole transaction: every
 * tensor whose name is a parameter of the served model is staged (as at load, names the model
 * does not have, e.g. rotary inv_freq buffers or a tied lm_head, are skipped), then committed.
 * Only tensors are read; config.json is not (the served architecture and shapes stay as loaded,
 * and a checkpoint of another shape fails on its first tensor).
 *
 * Path restriction. The route is off unless the daemon was started with --allowed-weight-dir DIR;
 * then model_path must resolve (realpath: "..", symlinked directories) to DIR or a directory below
 * it, and so must every file read (the index and each shard: a symlinked shard pointing outside DIR
 * is refused). A symlink swapped between that check and the read is not guarded against: DIR is
 * meant to be writable only by the trainer and the operator.
 */
#ifndef RS_SYNC_DISK_H
#define RS_SYNC_DISK_H

#include <stdbool.h>

#include "sync.h"

/* True when `real` (a realpath) is `dir` (a realpath) or inside it. */
bool rs_disk_path_inside(const char *real, const char *dir);

/* The job (sync service thread). RS_EINVAL (400) with param "model_path" when the route is
 * disabled, the path does not resolve, or it or a file in it escapes allowed-weight-dir; RS_ESTATE
 * (409) while a streamed update is open; tensor errors as for any transaction. */
int rs_disk_update(rs_sync *s, const rs_disk_update_req *r, rs_sync_result *res, rs_error *err);

#endif /* RS_SYNC_DISK_H */
