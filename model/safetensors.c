/*
 * safetensors.c — the safetensors parser, the model-directory view over shards, and the writer
 * (see safetensors.h for the format).
 *
 * The parser treats the file as hostile: it reads nothing before checking the bound, does all
 * size arithmetic in uint64_t with overflow checks, and only hands out data pointers whose whole
 * [offset, offset + nbytes) range lies inside the data section. The header JSON goes through
 * jansson with duplicate keys rejected; jansson itself bounds nesting depth and rejects NUL bytes
 * and invalid UTF-8 in strings. The checks follow the reference Rust implementation
 * (safetensors::tensor::Metadata::validate) except that gaps between tensors and trailing bytes
 * are tolerated; overlapping tensors are not.
 *
 * Files are mmap'ed read-only (MAP_PRIVATE), so opening a 60 GB checkpoint costs address space,
 * not memory; the loader copies each tensor to its backend and then closes the mapping. The header
 * is read with pread and only tensor bytes through the mapping, so a file truncated under it can
 * fault (SIGBUS) only where its reader chose to read; sync/disk.c guards those reads
 * (sync/shm_guard.h) and asks rs_st_size_now afterwards.
 */
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define ST_PATH_MAX 4096
#define ST_INDEX_MAX_BYTES (64u << 20) /* model.safetensors.index.json */
#define ST_WRITE_CHUNK (4u << 20)

struct rs_st_file {
    char *label;                /* owned: path or label for messages */
    const uint8_t *base;        /* [len] the whole file image; borrowed (parse) or our mapping (open) */
    size_t len;
    void *map;                  /* owned mapping of [len] bytes when opened from a path, else NULL */
    int fd;                     /* the mapped file (rs_st_open), kept for rs_st_size_now; -1 for a buffer */
    rs_st_tensor *tensors;      /* [n] in data-offset order */
    size_t n;
    const rs_st_tensor **by_name; /* [n] sorted by name for rs_st_find */
    char *arena;                /* owned: every name and metadata string */
    const char **meta;          /* [2 * n_meta] key, value pairs */
    size_t n_meta;
};

/* ---- errors ---- */

static int st_error(rs_error *err, int code, const char *label, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

static int st_error(rs_error *err, int code, const char *label, const char *param, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return rs_error_set(err, code, param, "%s: %s", label, msg);
}

/* ---- dtypes: every dtype of the safetensors spec, with its size in bits ---- */

static const struct {
    const char *name;
    unsigned bits;
} st_dtypes[] = {
    {"BOOL", 8}, {"U8", 8},   {"I8", 8},   {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8},
    {"I16", 16}, {"U16", 16}, {"F16", 16}, {"BF16", 16},   {"I32", 32},    {"U32", 32},
    {"F32", 32}, {"F64", 64}, {"I64", 64}, {"U64", 64},    {"C64", 64},    {"F4", 4},
    {"F6_E2M3", 6}, {"F6_E3M2", 6},
};

/* Returns the table's copy of the name (static storage) or NULL when `s` is no safetensors dtype. */
static const char *st_dtype_lookup(const char *s, unsigned *bits, rs_dtype *dt) {
    for (size_t i = 0; i < RS_ARRAY_LEN(st_dtypes); i++) {
        if (strcmp(s, st_dtypes[i].name) == 0) {
            *bits = st_dtypes[i].bits;
            if (rs_dtype_from_safetensors(s, dt) != RS_OK) *dt = RS_DTYPE_COUNT;
            return st_dtypes[i].name;
        }
    }
    return NULL;
}

static uint64_t load_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static int cmp_tensor_offset(const void *a, const void *b) {
    const rs_st_tensor *x = a, *y = b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->nbytes != y->nbytes) return x->nbytes < y->nbytes ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int cmp_tensor_name(const void *a, const void *b) {
    const rs_st_tensor *const *x = a, *const *y = b;
    return strcmp((*x)->name, (*y)->name);
}

/* Reads a JSON integer in [0, INT64_MAX]; 0 on success. */
static int json_u64(const json_t *v, uint64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return -1;
    *out = (uint64_t)json_integer_value(v);
    return 0;
}

/* Validates one header entry `name` -> `v` into t (name and st_dtype filled by the caller). */
static int parse_entry(rs_st_tensor *t, const char *name, const json_t *v, uint64_t data_len,
                       const char *label, rs_error *err) {
    if (!json_is_object(v))
        return st_error(err, RS_EFORMAT, label, name, "tensor '%s': header entry is not an object", name);
    const json_t *jd = json_object_get(v, "dtype");
    const json_t *js = json_object_get(v, "shape");
    const json_t *jo = json_object_get(v, "data_offsets");
    if (!json_is_string(jd))
        return st_error(err, RS_EFORMAT, label, name, "tensor '%s': missing or non-string \"dtype\"", name);
    if (!json_is_array(js))
        return st_error(err, RS_EFORMAT, label, name, "tensor '%s': missing or non-array \"shape\"", name);
    if (!json_is_array(jo) || json_array_size(jo) != 2)
        return st_error(err, RS_EFORMAT, label, name,
                        "tensor '%s': \"data_offsets\" must be an array [begin, end]", name);

    unsigned bits = 0;
    t->st_dtype = st_dtype_lookup(json_string_value(jd), &bits, &t->dtype);
    if (!t->st_dtype)
        return st_error(err, RS_EUNSUPPORTED, label, name, "tensor '%s': unknown dtype \"%.32s\"", name,
                        json_string_value(jd));

    size_t nd = json_array_size(js);
    if (nd > RS_TENSOR_MAX_DIMS)
        return st_error(err, RS_EFORMAT, label, name, "tensor '%s': %zu dims, at most %d supported", name, nd,
                        RS_TENSOR_MAX_DIMS);
    t->ndim = (int)nd;
    uint64_t numel = 1;
    for (size_t i = 0; i < nd; i++) {
        uint64_t d;
        if (json_u64(json_array_get(js, i), &d) != 0)
            return st_error(err, RS_EFORMAT, label, name, "tensor '%s': shape[%zu] is not a non-negative integer",
                            name, i);
        t->shape[i] = (int64_t)d;
        if (__builtin_mul_overflow(numel, d, &numel))
            return st_error(err, RS_EFORMAT, label, name, "tensor '%s': shape overflows 64-bit element count",
                            name);
    }
    for (size_t i = nd; i < RS_TENSOR_MAX_DIMS; i++) t->shape[i] = 0;
    uint64_t nbits;
    if (__builtin_mul_overflow(numel, (uint64_t)bits, &nbits))
        return st_error(err, RS_EFORMAT, label, name, "tensor '%s': shape overflows 64-bit byte count", name);
    if (nbits % 8 != 0)
        return st_error(err, RS_EFORMAT, label, name, "tensor '%s': %s shape is not a whole number of bytes",
                        name, t->st_dtype);

    uint64_t begin, end;
    if (json_u64(json_array_get(jo, 0), &begin) != 0 || json_u64(json_array_get(jo, 1), &end) != 0)
        return st_error(err, RS_EFORMAT, label, name,
                        "tensor '%s': data_offsets are not non-negative integers", name);
    if (begin > end || end > data_len)
        return st_error(err, RS_EFORMAT, label, name,
                        "tensor '%s': data_offsets [%llu, %llu] outside the %llu-byte data section", name,
                        (unsigned long long)begin, (unsigned long long)end, (unsigned long long)data_len);
    if (end - begin != nbits / 8)
        return st_error(err, RS_EFORMAT, label, name,
                        "tensor '%s': data_offsets span %llu bytes but %s shape needs %llu", name,
                        (unsigned long long)(end - begin), t->st_dtype, (unsigned long long)(nbits / 8));
    t->offset = begin;
    t->nbytes = end - begin;
    return RS_OK;
}

/* Copies s into the arena at *pos and returns the copy. */
static const char *arena_put(char *arena, size_t *pos, const char *s) {
    size_t n = strlen(s) + 1;
    char *d = arena + *pos;
    memcpy(d, s, n);
    *pos += n;
    return d;
}

/* The header length of a `len`-byte file whose first 8 bytes are `le8`, bounded by the limit and
 * by the file. A bad one is not quoted: those 8 bytes may be anything (the start of a file that
 * is not a checkpoint at all), and a message must not hand a file's bytes to the client. */
static int header_len(const uint8_t *le8, size_t len, const char *label, uint64_t *hlen, rs_error *err) {
    *hlen = load_le64(le8);
    if (*hlen > RS_ST_MAX_HEADER)
        return st_error(err, RS_EFORMAT, label, NULL, "invalid header length (over the %llu-byte limit)",
                        RS_ST_MAX_HEADER);
    if (*hlen > len - 8)
        return st_error(err, RS_EFORMAT, label, NULL, "invalid header length (it runs past the end of the %zu-byte "
                        "file)", len);
    return RS_OK;
}

/* Parses the header JSON `head` [hlen] of the file image buf [len] (head is the image's own bytes
 * 8.., or a copy of them read before the image was mapped). */
static int parse_header(rs_st_file **out, const char *head, uint64_t hlen, const uint8_t *buf, size_t len,
                        const char *label, rs_error *err) {
    json_t *root = NULL;
    rs_st_file *f = NULL;
    int rc;
    if (hlen < 2 || head[0] != '{')
        return st_error(err, RS_EFORMAT, label, NULL, "header is not a JSON object");
    uint64_t data_len = (uint64_t)(len - 8 - (size_t)hlen);
    const uint8_t *data = buf + 8 + hlen;

    json_error_t jerr;
    root = json_loadb(head, (size_t)hlen, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return st_error(err, RS_EFORMAT, label, NULL, "header JSON: %s (line %d, column %d)", jerr.text,
                        jerr.line, jerr.column);
    if (!json_is_object(root)) {
        rc = st_error(err, RS_EFORMAT, label, NULL, "header is not a JSON object");
        goto fail;
    }

    /* First pass: count tensors and metadata, size the string arena. */
    const json_t *meta = json_object_get(root, "__metadata__");
    if (meta && !json_is_object(meta)) {
        rc = st_error(err, RS_EFORMAT, label, "__metadata__", "__metadata__ is not an object");
        goto fail;
    }
    size_t n_meta = meta ? json_object_size(meta) : 0;
    size_t n = json_object_size(root) - (meta ? 1 : 0);
    size_t arena_bytes = 1;
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (strcmp(key, "__metadata__") != 0) arena_bytes += strlen(key) + 1;
    }
    if (meta) {
        json_object_foreach((json_t *)meta, key, val) {
            if (!json_is_string(val)) {
                rc = st_error(err, RS_EFORMAT, label, key, "__metadata__.%s is not a string", key);
                goto fail;
            }
            arena_bytes += strlen(key) + 1 + strlen(json_string_value(val)) + 1;
        }
    }

    f = rs_xcalloc(1, sizeof *f);
    f->label = rs_xstrdup(label);
    f->base = buf;
    f->len = len;
    f->fd = -1;
    f->n = n;
    f->tensors = rs_xcalloc(n ? n : 1, sizeof *f->tensors);
    f->by_name = rs_xcalloc(n ? n : 1, sizeof *f->by_name);
    f->arena = rs_xmalloc(arena_bytes);
    f->meta = rs_xcalloc(2 * n_meta + 1, sizeof *f->meta);
    f->n_meta = n_meta;

    /* Second pass: validate every tensor. */
    size_t pos = 0, i = 0;
    json_object_foreach(root, key, val) {
        if (strcmp(key, "__metadata__") == 0) continue;
        rs_st_tensor *t = &f->tensors[i++];
        t->name = arena_put(f->arena, &pos, key);
        if ((rc = parse_entry(t, t->name, val, data_len, label, err)) != RS_OK) goto fail;
        t->data = data + t->offset;
    }
    RS_ASSERT(i == n);
    size_t m = 0;
    if (meta) {
        json_object_foreach((json_t *)meta, key, val) {
            f->meta[m++] = arena_put(f->arena, &pos, key);
            f->meta[m++] = arena_put(f->arena, &pos, json_string_value(val));
        }
    }

    /* Iteration order is data order; overlapping ranges mean a corrupt or hostile file. */
    qsort(f->tensors, n, sizeof *f->tensors, cmp_tensor_offset);
    for (i = 1; i < n; i++) {
        const rs_st_tensor *a = &f->tensors[i - 1], *b = &f->tensors[i];
        if (b->offset < a->offset + a->nbytes) {
            rc = st_error(err, RS_EFORMAT, label, b->name, "tensor '%s' overlaps tensor '%s' in the data section",
                          b->name, a->name);
            goto fail;
        }
    }
    for (i = 0; i < n; i++) f->by_name[i] = &f->tensors[i];
    qsort(f->by_name, n, sizeof *f->by_name, cmp_tensor_name);

    json_decref(root);
    *out = f;
    return RS_OK;

fail:
    json_decref(root);
    rs_st_close(f);
    return rc;
}

int rs_st_parse(rs_st_file **out, const uint8_t *buf, size_t len, const char *label, rs_error *err) {
    if (!label) label = "<memory>";
    if (len < 8)
        return st_error(err, RS_EFORMAT, label, NULL, "%zu bytes, too short for the 8-byte header length", len);
    uint64_t hlen;
    int rc = header_len(buf, len, label, &hlen, err);
    if (rc != RS_OK) return rc;
    return parse_header(out, (const char *)buf + 8, hlen, buf, len, label, err);
}

/* Reads exactly n bytes at off: 0, or -1 with errno set (0 when the file ended first). */
static int pread_full(int fd, void *buf, size_t n, off_t off) {
    for (size_t got = 0; got < n;) {
        ssize_t k = pread(fd, (char *)buf + got, n - got, off + (off_t)got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            if (k == 0) errno = 0;
            return -1;
        }
        got += (size_t)k;
    }
    return 0;
}

/* Opens `path` for reading. O_NONBLOCK: a FIFO put where a shard is expected would otherwise block
 * the open until some writer comes, and with it the sync thread; it now opens at once and fails
 * S_ISREG in rs_st_open_fd. It changes nothing for a regular file or its mapping. */
static int open_path(const char *path, int *fd, rs_error *err) {
    *fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (*fd < 0)
        return st_error(err, errno == ENOENT ? RS_ENOTFOUND : RS_EIO, path, NULL, "cannot open: %s",
                        strerror(errno));
    return RS_OK;
}

int rs_st_open(rs_st_file **out, const char *path, rs_error *err) {
    int fd;
    int rc = open_path(path, &fd, err);
    if (rc != RS_OK) return rc;
    return rs_st_open_fd(out, fd, path, err);
}

int rs_st_open_fd(rs_st_file **out, int fd, const char *path, rs_error *err) {
    int rc;
    char *head = NULL;
    void *map = MAP_FAILED;
    size_t len = 0;
    rs_st_file *f = NULL;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        rc = st_error(err, RS_EIO, path, NULL, "cannot stat: %s", strerror(errno));
        goto fail;
    }
    if (!S_ISREG(st.st_mode)) {
        rc = st_error(err, RS_EIO, path, NULL, "not a regular file");
        goto fail;
    }
    len = (size_t)st.st_size;
    if (len < 8) {
        rc = st_error(err, RS_EFORMAT, path, NULL, "%zu bytes, too short for the 8-byte header length", len);
        goto fail;
    }
    /* The header is read with pread, not through the mapping: a file truncated meanwhile then
     * fails here with an error instead of faulting (SIGBUS) before any caller could guard the
     * mapping (sync/shm_guard.h). Only tensor bytes are read through the mapping. */
    uint8_t le8[8];
    uint64_t hlen;
    if (pread_full(fd, le8, 8, 0) != 0) {
        rc = st_error(err, RS_EIO, path, NULL, "cannot read the header length: %s",
                      errno ? strerror(errno) : "the file shrank while it was being opened");
        goto fail;
    }
    if ((rc = header_len(le8, len, path, &hlen, err)) != RS_OK) goto fail;
    head = rs_xmalloc(hlen ? (size_t)hlen : 1);
    if (pread_full(fd, head, (size_t)hlen, 8) != 0) {
        rc = st_error(err, RS_EIO, path, NULL, "cannot read the %llu-byte header: %s", (unsigned long long)hlen,
                      errno ? strerror(errno) : "the file shrank while it was being opened");
        goto fail;
    }
    map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        rc = st_error(err, RS_EIO, path, NULL, "mmap failed: %s", strerror(errno));
        goto fail;
    }
    if ((rc = parse_header(&f, head, hlen, map, len, path, err)) != RS_OK) goto fail;
    free(head);
    f->map = map;
    f->fd = fd; /* kept, so that rs_st_size_now asks the file that is mapped (even once its path is replaced) */
    *out = f;
    return RS_OK;

fail:
    if (map != MAP_FAILED) munmap(map, len);
    free(head);
    close(fd);
    return rc;
}

void rs_st_close(rs_st_file *f) {
    if (!f) return;
    if (f->map) munmap(f->map, f->len);
    if (f->fd >= 0) close(f->fd);
    free(f->label);
    free(f->tensors);
    free(f->by_name);
    free(f->arena);
    free(f->meta);
    free(f);
}

const char *rs_st_label(const rs_st_file *f) { return f->label; }

const void *rs_st_mapping(const rs_st_file *f, size_t *len) {
    *len = f->map ? f->len : 0;
    return f->map;
}

int rs_st_size_now(const rs_st_file *f, uint64_t *size, rs_error *err) {
    if (f->fd < 0) return st_error(err, RS_EINVAL, f->label, NULL, "not opened from a file");
    struct stat st;
    if (fstat(f->fd, &st) != 0) return st_error(err, RS_EIO, f->label, NULL, "cannot stat: %s", strerror(errno));
    *size = st.st_size > 0 ? (uint64_t)st.st_size : 0;
    return RS_OK;
}
size_t rs_st_count(const rs_st_file *f) { return f->n; }

const rs_st_tensor *rs_st_tensor_at(const rs_st_file *f, size_t i) {
    RS_ASSERT(i < f->n);
    return &f->tensors[i];
}

const rs_st_tensor *rs_st_find(const rs_st_file *f, const char *name) {
    size_t lo = 0, hi = f->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(f->by_name[mid]->name, name);
        if (c == 0) return f->by_name[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

const char *rs_st_metadata(const rs_st_file *f, const char *key) {
    for (size_t i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta[2 * i], key) == 0) return f->meta[2 * i + 1];
    return NULL;
}

/* ---- model directories ---- */

typedef struct st_dir_entry {
    const rs_st_tensor *t;      /* borrowed from shards[shard] */
    uint32_t shard;
} st_dir_entry;

struct rs_st_dir {
    rs_st_file **shards;        /* [n_shards] owned */
    size_t n_shards;
    st_dir_entry *entries;      /* [n] shard by shard, offset order within a shard */
    size_t n;
    uint32_t *by_name;          /* [n] entry indices sorted by name */
    size_t nbytes;
};

/* qsort has no context argument; name order over entries is built by sorting (name, index) pairs. */
typedef struct st_name_ix {
    const char *name;
    uint32_t ix;
} st_name_ix;

static int cmp_name_ix(const void *a, const void *b) {
    const st_name_ix *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    return c ? c : (x->ix < y->ix ? -1 : x->ix > y->ix);
}

static int cmp_cstr(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

/* A shard name from an index must stay inside the model directory. */
static int shard_name_ok(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > 255) return 0;
    if (strchr(s, '/') || strchr(s, '\\') || strstr(s, "..")) return 0;
    return strcmp(s, ".") != 0;
}

static int join_path(char *out, size_t cap, const char *dir, const char *file, rs_error *err) {
    int n = snprintf(out, cap, "%s/%s", dir, file);
    if (n < 0 || (size_t)n >= cap) return st_error(err, RS_EINVAL, dir, file, "path too long for '%s'", file);
    return RS_OK;
}

void rs_st_dir_close(rs_st_dir *d) {
    if (!d) return;
    for (size_t i = 0; i < d->n_shards; i++) rs_st_close(d->shards[i]);
    free(d->shards);
    free(d->entries);
    free(d->by_name);
    free(d);
}

/* Builds entries and the name index once all shards are open; rejects a name held by two shards. */
static int dir_index(rs_st_dir *d, rs_error *err) {
    size_t n = 0;
    for (size_t s = 0; s < d->n_shards; s++) n += rs_st_count(d->shards[s]);
    if (n > UINT32_MAX) return rs_error_set(err, RS_EFORMAT, NULL, "too many tensors (%zu)", n);
    d->n = n;
    d->entries = rs_xcalloc(n ? n : 1, sizeof *d->entries);
    d->by_name = rs_xcalloc(n ? n : 1, sizeof *d->by_name);
    st_name_ix *tmp = rs_xcalloc(n ? n : 1, sizeof *tmp);
    size_t k = 0;
    for (size_t s = 0; s < d->n_shards; s++) {
        for (size_t i = 0; i < rs_st_count(d->shards[s]); i++, k++) {
            d->entries[k].t = rs_st_tensor_at(d->shards[s], i);
            d->entries[k].shard = (uint32_t)s;
            d->nbytes += d->entries[k].t->nbytes;
            tmp[k] = (st_name_ix){d->entries[k].t->name, (uint32_t)k};
        }
    }
    qsort(tmp, n, sizeof *tmp, cmp_name_ix);
    for (k = 0; k < n; k++) {
        if (k > 0 && strcmp(tmp[k].name, tmp[k - 1].name) == 0) {
            const char *a = rs_st_label(d->shards[d->entries[tmp[k - 1].ix].shard]);
            const char *b = rs_st_label(d->shards[d->entries[tmp[k].ix].shard]);
            int rc = rs_error_set(err, RS_EFORMAT, tmp[k].name, "tensor '%s' is in both %s and %s", tmp[k].name,
                                  a, b);
            free(tmp);
            return rc;
        }
        d->by_name[k] = tmp[k].ix;
    }
    free(tmp);
    return RS_OK;
}

/* Loads the index JSON from fd (taken, and closed) into *root: checked to be a regular file before
 * a byte is read, and bounded in size. */
static int load_index(int fd, const char *index_path, json_t **root, rs_error *err) {
    int rc = RS_OK;
    struct stat st;
    json_error_t jerr;
    if (fstat(fd, &st) != 0)
        rc = st_error(err, RS_EIO, index_path, NULL, "cannot stat: %s", strerror(errno));
    else if (!S_ISREG(st.st_mode))
        rc = st_error(err, RS_EIO, index_path, NULL, "not a regular file");
    else if ((uint64_t)st.st_size > ST_INDEX_MAX_BYTES)
        rc = st_error(err, RS_EFORMAT, index_path, NULL, "%lld bytes, over the %u-byte limit",
                      (long long)st.st_size, ST_INDEX_MAX_BYTES);
    else if (!(*root = json_loadfd(fd, JSON_REJECT_DUPLICATES, &jerr)))
        rc = st_error(err, RS_EFORMAT, index_path, NULL, "%s (line %d, column %d)", jerr.text, jerr.line,
                      jerr.column);
    close(fd);
    return rc;
}

/* Opens the shards named by the index (index_fd, taken) through `open`, and checks the weight map
 * against them. */
static int dir_open_index(rs_st_dir *d, const char *dir, int index_fd, const char *index_path, rs_st_open_fn open_fn,
                          void *ctx, rs_error *err) {
    json_t *root = NULL;
    const char **names = NULL;
    int rc;
    if ((rc = load_index(index_fd, index_path, &root, err)) != RS_OK) return rc;
    json_t *wm = json_is_object(root) ? json_object_get(root, "weight_map") : NULL;
    if (!json_is_object(wm)) {
        rc = st_error(err, RS_EFORMAT, index_path, "weight_map", "missing or non-object \"weight_map\"");
        goto fail;
    }
    size_t n = json_object_size(wm);
    if (n == 0) {
        rc = st_error(err, RS_EFORMAT, index_path, "weight_map", "\"weight_map\" is empty");
        goto fail;
    }
    names = rs_xcalloc(n, sizeof *names);
    size_t k = 0;
    const char *key;
    json_t *val;
    json_object_foreach(wm, key, val) {
        if (!json_is_string(val)) {
            rc = st_error(err, RS_EFORMAT, index_path, key, "weight_map[\"%s\"] is not a string", key);
            goto fail;
        }
        if (!shard_name_ok(json_string_value(val))) {
            rc = st_error(err, RS_EFORMAT, index_path, key,
                          "weight_map[\"%s\"] = \"%.200s\" is not a plain file name inside the model directory",
                          key, json_string_value(val));
            goto fail;
        }
        names[k++] = json_string_value(val);
    }
    qsort(names, n, sizeof *names, cmp_cstr);
    size_t n_unique = 0;
    for (k = 0; k < n; k++)
        if (k == 0 || strcmp(names[k], names[n_unique - 1]) != 0) names[n_unique++] = names[k];

    d->shards = rs_xcalloc(n_unique, sizeof *d->shards);
    for (k = 0; k < n_unique; k++) {
        char path[ST_PATH_MAX];
        int fd;
        if ((rc = join_path(path, sizeof path, dir, names[k], err)) != RS_OK) goto fail;
        if ((rc = open_fn(ctx, names[k], &fd, err)) != RS_OK) goto fail;
        if ((rc = rs_st_open_fd(&d->shards[k], fd, path, err)) != RS_OK) goto fail;
        d->n_shards++;
    }
    json_object_foreach(wm, key, val) {
        const char *shard = json_string_value(val);
        const char **hit = bsearch(&shard, names, n_unique, sizeof *names, cmp_cstr);
        RS_ASSERT(hit);
        if (!rs_st_find(d->shards[hit - names], key)) {
            rc = st_error(err, RS_EFORMAT, index_path, key, "weight_map puts tensor '%s' in %s, which lacks it",
                          key, shard);
            goto fail;
        }
    }
    rc = RS_OK;
fail:
    free(names);
    json_decref(root);
    return rc;
}

int rs_st_dir_open_with(rs_st_dir **out, const char *dir, rs_st_open_fn open_fn, void *ctx, rs_error *err) {
    char single[ST_PATH_MAX], index[ST_PATH_MAX];
    int rc, fd;
    if ((rc = join_path(single, sizeof single, dir, "model.safetensors", err)) != RS_OK) return rc;
    if ((rc = join_path(index, sizeof index, dir, "model.safetensors.index.json", err)) != RS_OK) return rc;
    rs_st_dir *d = rs_xcalloc(1, sizeof *d);
    if ((rc = open_fn(ctx, "model.safetensors", &fd, err)) == RS_OK) {
        d->shards = rs_xcalloc(1, sizeof *d->shards);
        if ((rc = rs_st_open_fd(&d->shards[0], fd, single, err)) != RS_OK) goto fail;
        d->n_shards = 1;
    } else if (rc == RS_ENOTFOUND && (rc = open_fn(ctx, "model.safetensors.index.json", &fd, err)) == RS_OK) {
        if ((rc = dir_open_index(d, dir, fd, index, open_fn, ctx, err)) != RS_OK) goto fail;
    } else {
        if (rc == RS_ENOTFOUND)
            rc = st_error(err, RS_ENOTFOUND, dir, NULL, "neither model.safetensors nor model.safetensors.index.json");
        goto fail;
    }
    if ((rc = dir_index(d, err)) != RS_OK) goto fail;
    *out = d;
    return RS_OK;
fail:
    rs_st_dir_close(d);
    return rc;
}

/* rs_st_open_fn over a path (ctx): open(2), symlinks followed. */
static int open_in_dir(void *ctx, const char *name, int *fd, rs_error *err) {
    char path[ST_PATH_MAX];
    int rc = join_path(path, sizeof path, ctx, name, err);
    return rc == RS_OK ? open_path(path, fd, err) : rc;
}

int rs_st_dir_open(rs_st_dir **out, const char *dir, rs_error *err) {
    return rs_st_dir_open_with(out, dir, open_in_dir, (void *)dir, err);
}

size_t rs_st_dir_count(const rs_st_dir *d) { return d->n; }
size_t rs_st_dir_nbytes(const rs_st_dir *d) { return d->nbytes; }
size_t rs_st_dir_shard_count(const rs_st_dir *d) { return d->n_shards; }

const rs_st_file *rs_st_dir_shard(const rs_st_dir *d, size_t s) {
    RS_ASSERT(s < d->n_shards);
    return d->shards[s];
}

const rs_st_tensor *rs_st_dir_tensor_at(const rs_st_dir *d, size_t i, const char **file) {
    RS_ASSERT(i < d->n);
    if (file) *file = rs_st_label(d->shards[d->entries[i].shard]);
    return d->entries[i].t;
}

const rs_st_tensor *rs_st_dir_find(const rs_st_dir *d, const char *name, size_t *index, const char **file) {
    size_t lo = 0, hi = d->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const st_dir_entry *e = &d->entries[d->by_name[mid]];
        int c = strcmp(e->t->name, name);
        if (c == 0) {
            if (index) *index = d->by_name[mid];
            if (file) *file = rs_st_label(d->shards[e->shard]);
            return e->t;
        }
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

/* ---- writer ---- */

/* Builds the header JSON (unpadded) into *out (malloc'ed). */
static int build_header(const char *path, const rs_st_wtensor *ts, size_t n, char **out, rs_error *err) {
    json_t *h = json_object();
    int rc = RS_EINVAL;
    json_object_set_new(h, "__metadata__", json_pack("{s:s}", "format", "pt"));
    uint64_t offset = 0;
    for (size_t i = 0; i < n; i++) {
        const rs_st_wtensor *t = &ts[i];
        const char *name = t->name ? t->name : "(null)";
        if (!t->name || strcmp(t->name, "__metadata__") == 0 || json_object_get(h, t->name)) {
            rc = st_error(err, RS_EINVAL, path, name, "tensor %zu: missing, reserved or duplicate name '%s'", i,
                          name);
            goto fail;
        }
        if ((int)t->dtype < 0 || t->dtype >= RS_DTYPE_COUNT || t->ndim < 0 || t->ndim > RS_TENSOR_MAX_DIMS ||
            (!t->data && !t->fill)) {
            rc = st_error(err, RS_EINVAL, path, name, "tensor '%s': bad dtype, ndim or data source", name);
            goto fail;
        }
        uint64_t nbytes = rs_dtype_size(t->dtype);
        json_t *shape = json_array();
        for (int d = 0; d < t->ndim; d++) {
            if (t->shape[d] < 0 || __builtin_mul_overflow(nbytes, (uint64_t)t->shape[d], &nbytes)) {
                json_decref(shape);
                rc = st_error(err, RS_EINVAL, path, name, "tensor '%s': bad shape[%d] = %lld", name, d,
                              (long long)t->shape[d]);
                goto fail;
            }
            json_array_append_new(shape, json_integer(t->shape[d]));
        }
        if (offset + nbytes < offset || offset + nbytes > (uint64_t)INT64_MAX) {
            json_decref(shape);
            rc = st_error(err, RS_EINVAL, path, name, "tensor '%s': total size overflows", name);
            goto fail;
        }
        const char *st_name = NULL;
        for (size_t k = 0; k < RS_ARRAY_LEN(st_dtypes) && !st_name; k++) {
            rs_dtype dt;
            if (rs_dtype_from_safetensors(st_dtypes[k].name, &dt) == RS_OK && dt == t->dtype)
                st_name = st_dtypes[k].name;
        }
        RS_ASSERT(st_name);
        json_object_set_new(h, t->name,
                            json_pack("{s:s, s:o, s:[I, I]}", "dtype", st_name, "shape", shape, "data_offsets",
                                      (json_int_t)offset, (json_int_t)(offset + nbytes)));
        offset += nbytes;
    }
    *out = json_dumps(h, JSON_COMPACT);
    rc = *out ? RS_OK : st_error(err, RS_ENOMEM, path, NULL, "cannot serialize the header");
fail:
    json_decref(h);
    return rc;
}

static int write_all(FILE *fp, const void *p, size_t n, const char *path, rs_error *err) {
    if (n && fwrite(p, 1, n, fp) != n) return st_error(err, RS_EIO, path, NULL, "write failed: %s", strerror(errno));
    return RS_OK;
}

int rs_st_write(const char *path, const rs_st_wtensor *ts, size_t n, rs_error *err) {
    char tmp[ST_PATH_MAX];
    FILE *fp = NULL;
    uint8_t *chunk = NULL;
    int rc;
    int len = snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    if (len < 0 || (size_t)len >= sizeof tmp) return st_error(err, RS_EINVAL, path, NULL, "path too long");
    char *header = NULL;
    if ((rc = build_header(path, ts, n, &header, err)) != RS_OK) return rc;

    fp = fopen(tmp, "wb");
    if (!fp) {
        rc = st_error(err, RS_EIO, tmp, NULL, "cannot create: %s", strerror(errno));
        goto fail;
    }
    size_t hlen = strlen(header), padded = (hlen + 7) / 8 * 8;
    uint8_t le[8];
    for (int i = 0; i < 8; i++) le[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    if ((rc = write_all(fp, le, 8, tmp, err)) != RS_OK) goto fail;
    if ((rc = write_all(fp, header, hlen, tmp, err)) != RS_OK) goto fail;
    if ((rc = write_all(fp, "        ", padded - hlen, tmp, err)) != RS_OK) goto fail;

    for (size_t i = 0; i < n; i++) {
        const rs_st_wtensor *t = &ts[i];
        uint64_t nbytes = rs_dtype_size(t->dtype);
        for (int d = 0; d < t->ndim; d++) nbytes *= (uint64_t)t->shape[d]; /* checked in build_header */
        if (t->data) {
            if ((rc = write_all(fp, t->data, (size_t)nbytes, tmp, err)) != RS_OK) goto fail;
            continue;
        }
        if (!chunk) chunk = rs_xmalloc(ST_WRITE_CHUNK);
        for (uint64_t off = 0; off < nbytes; off += ST_WRITE_CHUNK) {
            size_t m = (size_t)RS_MIN((uint64_t)ST_WRITE_CHUNK, nbytes - off);
            if ((rc = t->fill(t->fill_ctx, chunk, off, m, err)) != RS_OK) goto fail;
            if ((rc = write_all(fp, chunk, m, tmp, err)) != RS_OK) goto fail;
        }
    }
    if (fclose(fp) != 0) {
        fp = NULL;
        rc = st_error(err, RS_EIO, tmp, NULL, "close failed: %s", strerror(errno));
        goto fail;
    }
    fp = NULL;
    if (rename(tmp, path) != 0) {
        rc = st_error(err, RS_EIO, path, NULL, "cannot rename %s into place: %s", tmp, strerror(errno));
        goto fail;
    }
    free(chunk);
    free(header);
    return RS_OK;

fail:
    if (fp) fclose(fp);
    unlink(tmp);
    free(chunk);
    free(header);
    return rc;
}
