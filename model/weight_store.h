/*
 * weight_store.h — a loaded model's weights as named slots, the conversion of a host tensor into a
 * slot's served format, and the weight store that owns the backend memory behind them.
 *
 * Slots. Every parameter the forward pass reads has one HF name and one rs_tensor slot in the
 * rs_model; rs_model_slot maps the name to the slot with its expected shape, and
 * `<matrix>_scale_inv` to the FP8 block scales of that matrix. Parameters are numbered in model
 * order (embed_tokens, then each layer: input_layernorm, q/k/v/o_proj, q/k/v biases, q/k norms,
 * post_attention_layernorm, then gate/up/down_proj or the router and each expert's
 * gate/up/down_proj; then model.norm and, unless tied, lm_head), which is the order a commit
 * names the first missing one in. Names are parsed whole (no substring tests): the router
 * `mlp.gate.weight` is never taken for a gate projection, a layer or expert index must be in range
 * and written without leading zeros, and a name the architecture does not have (a bias on Qwen3,
 * a dense MLP name on a sparse layer) is unknown.
 *
 * Served format. Each slot keeps the dtype it was loaded with: the quantization policy (quant.h)
 * decided it once, at load, and a weight update never changes it silently. An FP8 slot takes
 * BF16/F16/F32 (quantized with the same code as at load, so the codes are bit-identical to loading
 * the same tensor) or E4M3 codes with their block scales (copied, scales checked); a slot served
 * in BF16/F16/F32 takes BF16/F16/F32 (converted to its dtype) and refuses E4M3; vectors (norms,
 * biases) are F32 whatever arrives. The loader uses rs_weight_convert for every tensor it loads,
 * so a weight update and a fresh load of the same tensor give the same bytes.
 *
 * The weight store owns every backend allocation of a model (and of a staging area): allocations
 * are tracked by address so that a commit can release a slot's old memory and adopt the staged
 * memory in O(1) per tensor.
 */
#ifndef RS_MODEL_WEIGHT_STORE_H
#define RS_MODEL_WEIGHT_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/pool.h"
#include "../core/rs.h"
#include "../kernels/backend.h"
#include "model.h"

/* ---- the weight store ---- */

typedef struct rs_weight_store rs_weight_store;

rs_weight_store *rs_weight_store_new(rs_backend *b);        /* b borrowed */
void rs_weight_store_free(rs_weight_store *ws);             /* frees every allocation it owns; NULL ok */
/* A backend allocation owned by the store, or NULL when the backend is out of memory. A new one is
 * zeroed; one recycled from the donor's spares (below) holds old bytes: callers overwrite it all. */
void *rs_weight_store_alloc(rs_weight_store *ws, size_t bytes);
/* Frees allocation p, which the store must own (NULL is a no-op), or parks it among the store's
 * spares when the store keeps released allocations. */
void rs_weight_store_release(rs_weight_store *ws, void *p);

/* Recycling, for weight updates. Faulting in fresh memory costs more than the copy into it (on the
 * CPU backend 1 GB of new 4 KiB pages takes ~0.4 s against ~0.03 s to rewrite faulted ones), and
 * every update replaces every tensor by one of the same size. So the served model's store keeps
 * what a commit releases (keep_released), and each update's staging store takes from it (donor):
 * after the first update, staging reuses the previous version's memory. Memory in use then stays
 * at the peak that an update reaches anyway (served weights + one staged copy) instead of dropping
 * back between updates. A staging store freed without being adopted (an aborted update) parks its
 * allocations with the donor too. keep false frees the spares at once. Spares are not counted in
 * rs_weight_store_bytes. The spare list is locked: a commit parks on the engine thread. */
void rs_weight_store_keep_released(rs_weight_store *ws, bool keep);
void rs_weight_store_set_donor(rs_weight_store *ws, rs_weight_store *donor); /* NULL: none */
size_t rs_weight_store_spare_bytes(rs_weight_store *ws);
void rs_weight_store_trim(rs_weight_store *ws);              /* frees the spares */
/* Moves allocation p (owned by `from`) into ws, same backend. NULL is a no-op. */
void rs_weight_store_adopt(rs_weight_store *ws, rs_weight_store *from, void *p);
size_t rs_weight_store_bytes(const rs_weight_store *ws);   /* sum of the owned allocations' sizes */
size_t rs_weight_store_count(const rs_weight_store *ws);   /* owned allocations */
/* Threads that rs_weight_convert may use to quantize into this store (borrowed; NULL = the
 * caller's thread only). The pool must not be running anything else meanwhile. */
void rs_weight_store_set_pool(rs_weight_store *ws, rs_pool *pool);
/* Host array of expert descriptors kept with the store (freed with it); [n] zeroed. */
rs_tensor *rs_weight_store_experts(rs_weight_store *ws, size_t n);

/* ---- slots ---- */

typedef enum rs_slot_kind {
    RS_SLOT_MATRIX = 0,                 /* 2-D: embeddings, projections, router, experts, lm_head */
    RS_SLOT_VECTOR,                     /* 1-D: norms, biases (served F32) */
} rs_slot_kind;

typedef struct rs_slot_info {
    rs_slot_kind kind;
    int layer;                          /* decoder layer, -1 outside the layers */
    int index;                          /* parameter number in model order, -1 for a tied lm_head */
    int ndim;                           /* expected shape of the *named* tensor: */
    int64_t shape[2];                   /*   the slot's, or the block grid for a scale name */
    bool is_scale;                      /* the name is `<matrix>_scale_inv`; the slot is the matrix */
    bool tied;                          /* lm_head.weight of a tied model: it follows embed_tokens */
    bool fp8_eligible;                  /* an attention/MLP/expert projection (rs_quant_eligible) */
    bool served_fp8;                    /* the slot holds E4M3 codes + scale_inv */
} rs_slot_info;

/* The slot that HF parameter `name` loads into, with *info filled (info may be NULL); NULL for a
 * name the model does not have. For a tied model, "lm_head.weight" returns &m->lm_head (the
 * embedding's tensor) with info->tied set: an update may send it, and it is ignored. */
rs_tensor *rs_model_slot(rs_model *m, const char *name, rs_slot_info *info);

/* Number of parameters (tied lm_head not counted), and parameter i's name and slot. */
int rs_model_param_count(const rs_model *m);
rs_tensor *rs_model_param_at(rs_model *m, int i, char *name, size_t cap, rs_slot_info *info);

/* ---- conversion ---- */

/* A host tensor to convert; data may be unaligned (e.g. inside a safetensors mapping). */
typedef struct rs_weight_src {
    rs_dtype dtype;                     /* BF16, F16, F32, or E4M3 (with scale_inv) */
    int ndim;
    int64_t shape[2];
    const void *data;                   /* [numel] of dtype, borrowed */
    const void *scale_inv;              /* E4M3 only: [ceil(out/128)][ceil(in/128)] of scale_dtype */
    rs_dtype scale_dtype;               /* F32 or BF16 */
    bool has_crc32c;                    /* data's bytes must have this CRC-32C (core/crc32c.h) */
    uint32_t crc32c;
} rs_weight_src;

/* Converts src into new allocations of `ws` in format `served` and describes them in *out
 * (dtype, ndim, shape, data, scale_inv):
 *   served E4M3:        src BF16/F16/F32 2-D -> rs_fp8_quantize_weight; src E4M3 -> codes copied
 *                       and scales widened to F32 after checking they are finite and >= 0;
 *   served BF16/F16/F32 2-D: src BF16/F16/F32 converted (same dtype: copied);
 *   served F32 1-D:     src BF16/F16/F32 widened.
 * Anything else (E4M3 into a non-FP8 slot, an unsupported dtype) is RS_EUNSUPPORTED naming
 * `name`; RS_ENOMEM when the backend is full. A tensor that holds a NaN or an infinity (an E4M3
 * NaN code; a finite F32 that overflows the served BF16/F16 counts too), or whose bytes do not
 * have src->crc32c, is RS_EFORMAT naming `name`, the first bad element's index and value, or the
 * two CRCs: checked in the conversion pass itself (weight_store.c). On any failure nothing is left
 * allocated. Shapes must have been checked by the caller. scale_inv NULL with src E4M3 converts
 * the codes only (*out's scale_inv stays NULL). */
int rs_weight_convert(rs_weight_store *ws, const char *name, rs_dtype served, const rs_weight_src *src,
                      rs_tensor *out, rs_error *err);

/* Converts and uploads FP8 block scales alone ([ceil(out/128)][ceil(in/128)] of scale_dtype, F32
 * or BF16) into a new F32 allocation of ws (*out); checks they are finite and >= 0. */
int rs_weight_convert_scales(rs_weight_store *ws, const char *name, const void *scales, rs_dtype scale_dtype,
                             int64_t rows, int64_t cols, float **out, rs_error *err);

/* Bytes a matrix [out][in] takes served as E4M3: codes + fp32 block scales. */
size_t rs_fp8_served_bytes(int64_t out, int64_t in);

#endif /* RS_MODEL_WEIGHT_STORE_H */
