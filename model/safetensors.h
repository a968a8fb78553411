/*
 * safetensors.h — reading and writing the safetensors checkpoint format.
 *
 * A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
 *   {"name": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [begin, end]}, ...,
 *    "__metadata__": {"format": "pt"}}
 * and then the raw tensor bytes; offsets are relative to the first byte after the header.
 *
 * Every byte of a file is untrusted: the parser bounds the header length, checks every tensor
 * (known dtype, at most RS_TENSOR_MAX_DIMS dims, numel * element size == end - begin computed with
 * overflow checks, begin <= end <= data size, no two tensors overlapping) and answers RS_EFORMAT or
 * RS_EUNSUPPORTED with a message naming the file and the tensor or key at fault. After a successful
 * parse every rs_st_tensor.data pointer addresses exactly nbytes readable bytes.
 *
 * Three layers:
 *   rs_st_parse / rs_st_open   one file, from memory (the fuzz target) or mmap'ed read-only;
 *   rs_st_dir_open             a model directory: model.safetensors, or the shards listed by
 *                              model.safetensors.index.json, behind one name lookup;
 *   rs_st_write                writes a file, streaming tensor bytes through a fill callback so
 *                              a large model is never held in memory.
 */
#ifndef RS_SAFETENSORS_H
#define RS_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "../core/rs.h"
#include "../kernels/tensor.h"

#define RS_ST_MAX_HEADER 100000000ull /* bytes of header JSON, the reference implementation's limit */

typedef struct rs_st_tensor {
    const char *name;       /* owned by the file */
    const char *st_dtype;   /* the header's dtype string, e.g. "BF16"; owned by the file */
    rs_dtype dtype;         /* RS_DTYPE_COUNT for a valid safetensors dtype rolloutd cannot hold (BOOL, F64, ...) */
    int ndim;               /* 0..RS_TENSOR_MAX_DIMS; 0 is a scalar (one element) */
    int64_t shape[RS_TENSOR_MAX_DIMS];
    uint64_t offset;        /* of the first byte, relative to the data section */
    uint64_t nbytes;        /* == numel * element size */
    const void *data;       /* [nbytes] inside the file's bytes; borrowed, valid until close; not aligned */
} rs_st_tensor;

typedef struct rs_st_file rs_st_file;

/* Parses a file image held in memory. `buf` is borrowed and must outlive the returned file;
 * `label` names the bytes in error messages (a path, or "<memory>"). */
int rs_st_parse(rs_st_file **out, const uint8_t *buf, size_t len, const char *label, rs_error *err);

/* Maps `path` read-only and parses it. RS_ENOTFOUND when the file does not exist, RS_EIO when it
 * cannot be read or is not a regular file (a FIFO is refused at once, never waited on),
 * RS_EFORMAT / RS_EUNSUPPORTED for bad contents. The header is read with pread, so nothing is
 * read through the mapping before rs_st_open returns; the descriptor stays open until close. */
int rs_st_open(rs_st_file **out, const char *path, rs_error *err);
/* rs_st_open of a file already open for reading: `fd` is taken (closed on failure, or by
 * rs_st_close), `label` names it in messages. RS_EIO when it is not a regular file. */
int rs_st_open_fd(rs_st_file **out, int fd, const char *label, rs_error *err);
void rs_st_close(rs_st_file *f);

const char *rs_st_label(const rs_st_file *f);                    /* path or label given at open */
/* The read-only mapping of a file from rs_st_open ([*len] bytes), where every tensor's data lies;
 * NULL (and *len 0) for one from rs_st_parse. */
const void *rs_st_mapping(const rs_st_file *f, size_t *len);
/* The size of the file from rs_st_open now (fstat of its descriptor: the file that is mapped, even
 * if its path has been replaced since), to tell whether it shrank under the mapping. RS_EIO if it
 * cannot be had, RS_EINVAL for a file from rs_st_parse. */
int rs_st_size_now(const rs_st_file *f, uint64_t *size, rs_error *err);
size_t rs_st_count(const rs_st_file *f);                         /* tensors, in data-offset order */
const rs_st_tensor *rs_st_tensor_at(const rs_st_file *f, size_t i);
const rs_st_tensor *rs_st_find(const rs_st_file *f, const char *name); /* NULL when absent; O(log n) */
const char *rs_st_metadata(const rs_st_file *f, const char *key);      /* __metadata__ value or NULL */

/* ---- a model directory: one file or an index of shards ---- */

typedef struct rs_st_dir rs_st_dir;

/* Opens dir/model.safetensors, or else every shard named by dir/model.safetensors.index.json
 * ({"weight_map": {tensor: shard}}). Shard names must be plain file names inside dir (no '/',
 * no ".."); every tensor the weight map lists must be in the shard it names; a tensor name present
 * in two shards is an error. RS_ENOTFOUND when neither file exists. Symlinks are followed (the
 * directory is the operator's, e.g. a Hugging Face cache snapshot). */
int rs_st_dir_open(rs_st_dir **out, const char *dir, rs_error *err);
void rs_st_dir_close(rs_st_dir *d);

/* Opens the file `name` (a plain file name) of a model directory for reading into *fd (the caller
 * takes it). RS_ENOTFOUND (with err set) when there is none; any other failure (err set) stops the
 * directory's open with that error. */
typedef int (*rs_st_open_fn)(void *ctx, const char *name, int *fd, rs_error *err);
/* rs_st_dir_open, with every file (the single file, the index, each shard) opened by `open_fn` (ctx
 * passed through) rather than by path: each name is opened once and only what it opened is read.
 * `dir` only labels the files in messages. */
int rs_st_dir_open_with(rs_st_dir **out, const char *dir, rs_st_open_fn open_fn, void *ctx, rs_error *err);

/* Tensors of all shards, numbered 0..count-1 (shard by shard, data-offset order within a shard). */
size_t rs_st_dir_count(const rs_st_dir *d);
const rs_st_tensor *rs_st_dir_tensor_at(const rs_st_dir *d, size_t i, const char **file /* may be NULL */);
/* Looks a tensor up by name; *index (if non-NULL) receives its number. NULL when absent. */
const rs_st_tensor *rs_st_dir_find(const rs_st_dir *d, const char *name, size_t *index,
                                   const char **file /* path of its shard; may be NULL */);
size_t rs_st_dir_nbytes(const rs_st_dir *d); /* tensor bytes over all shards */
/* The shards, in the order their tensors are numbered (shard s's tensors are rs_st_count of it,
 * in data-offset order); borrowed, valid until rs_st_dir_close. */
size_t rs_st_dir_shard_count(const rs_st_dir *d);
const rs_st_file *rs_st_dir_shard(const rs_st_dir *d, size_t s);

/* ---- writing ---- */

/* Produces bytes [byte_offset, byte_offset + nbytes) of a tensor into dst. Offsets and sizes are
 * multiples of 8 bytes except for the last chunk, so every chunk holds whole elements. */
typedef int (*rs_st_fill_fn)(void *ctx, void *dst, uint64_t byte_offset, size_t nbytes, rs_error *err);

typedef struct rs_st_wtensor {
    const char *name;
    rs_dtype dtype;
    int ndim;
    int64_t shape[RS_TENSOR_MAX_DIMS];
    const void *data;       /* borrows: all bytes of the tensor, or NULL to use fill */
    rs_st_fill_fn fill;
    void *fill_ctx;
} rs_st_wtensor;

/* Writes tensors[0..n) in order (data offsets ascending, header padded with spaces to 8 bytes,
 * __metadata__ {"format": "pt"}) to path through a temporary file renamed into place, so a
 * reader never sees half a file. Memory use is one 4 MiB chunk whatever the tensor sizes. */
int rs_st_write(const char *path, const rs_st_wtensor *tensors, size_t n, rs_error *err);

#endif /* RS_SAFETENSORS_H */
