/*
 * disk.h — the checkpoint-directory transport: /update_weights_from_disk.
 *
 * Reads a Hugging Face safetensors directory (model.safetensors, or the shards of
 * model.safetensors.index.json) through rs_st_dir_open_with and runs it as one whole transaction: every
 * tensor whose name is a parameter of the served model is staged, and so are the FP8 KV scales
 * `model.layers.N.self_attn.k_scale` / `v_scale` (taken exactly as an shm push of the same tensors
 * takes them: applied under --kv-scale-mode static, all layers or none), then committed. As at
 * load, names the model does not have (e.g. rotary inv_freq buffers or a tied lm_head) are skipped.
 * Only tensors are read; config.json is not (the served architecture and shapes stay as loaded,
 * and a checkpoint of another shape fails on its first tensor).
 *
 * Path restriction. The route is off unless the daemon was started with --allowed-weight-dir DIR.
 * model_path must be absolute, must not hold a ".." component, and must name DIR (or a path that
 * resolves to it) followed by names below it. Everything below DIR is opened relative to a
 * descriptor of DIR without following any symlink and without crossing a mount point (confine.h:
 * openat2 RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV, or an O_NOFOLLOW walk where
 * openat2 is filtered): the checkpoint directory, model.safetensors, the index, every shard. Each
 * name is looked up once, by the open that reads it, and what was opened is checked (a directory,
 * or a regular file, on DIR's device); so a symlink swapped in at any moment is refused, never
 * followed, and no byte of a file outside DIR reaches staging or an error message. Files are opened
 * without blocking (a FIFO is refused at once, never waited on). Every refusal (missing, a symlink,
 * another device) gets the same 400, naming neither a target nor errno.
 *
 * What this still takes on trust:
 *   - DIR itself and the directories above it: its path is resolved (symlinks followed) when the
 *     daemon starts and opened again for each request; whoever can replace DIR (or a parent) can
 *     point it anywhere. They belong to the operator.
 *   - hard links: a file hard-linked into DIR is DIR's file (it must be on DIR's device; Linux's
 *     fs.protected_hardlinks keeps a user from linking files they do not own or cannot read);
 *   - device nodes: opening one can have effects, and making one needs privilege;
 *   - the fallback walk (no openat2) refuses another device but not a bind mount of the same file
 *     system below DIR; making a mount needs privilege.
 * Symlinks inside DIR are never followed, even to files inside it: a checkpoint is written as
 * plain files (save_pretrained and safetensors do), not as a Hugging Face cache snapshot.
 *
 * A checkpoint file the trainer truncates while it is being read (rewriting it in place) fails the
 * update with a 400 instead of killing the daemon with SIGBUS (disk.c); the old weights keep
 * serving.
 */
#ifndef RS_SYNC_DISK_H
#define RS_SYNC_DISK_H

#include "sync_internal.h"

/* The job (sync service thread). RS_EINVAL (400) with param "model_path" when the route is
 * disabled, the path is refused (above), a file is missing or not a regular file, or a file shrank
 * while it was read; RS_ESTATE (409) while a streamed update is open; RS_EBUSY (503) if no
 * SIGBUS guard slot is free; tensor errors as for any transaction. */
int rs_disk_update(rs_sync *s, const rs_disk_update_req *r, rs_sync_result *res, rs_error *err);

/* Tests only: when non-NULL, rs_disk_update calls it on the service thread once the checkpoint in
 * `model_dir` is open (every shard mapped and parsed) and the transaction joined, before the first
 * tensor is read; a test truncates a shard there to reproduce a trainer that rewrites the
 * checkpoint mid-request, deterministically. NULL in the daemon. */
extern void (*rs_disk_test_hook_opened)(const char *model_dir);

#endif /* RS_SYNC_DISK_H */
