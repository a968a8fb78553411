/*
 * tensor.c — dtype table and scalar float conversions shared by every backend.
 */
#include "tensor.h"

#include <string.h>

#include "../core/rs.h"

static const struct {
    const char *name;       /* our name, as in docs/api.md manifests */
    const char *st_name;    /* safetensors header name */
    size_t size;
} dtype_table[RS_DTYPE_COUNT] = {
    [RS_DTYPE_F32]  = {"float32", "F32", 4},
    [RS_DTYPE_F16]  = {"float16", "F16", 2},
    [RS_DTYPE_BF16] = {"bfloat16", "BF16", 2},
    [RS_DTYPE_E4M3] = {"float8_e4m3fn", "F8_E4M3", 1},
    [RS_DTYPE_E5M2] = {"float8_e5m2", "F8_E5M2", 1},
    [RS_DTYPE_I32]  = {"int32", "I32", 4},
    [RS_DTYPE_I64]  = {"int64", "I64", 8},
};

size_t rs_dtype_size(rs_dtype dt) {
    RS_ASSERT(dt >= 0 && dt < RS_DTYPE_COUNT);
    return dtype_table[dt].size;
}

const char *rs_dtype_name(rs_dtype dt) {
    return (dt >= 0 && dt < RS_DTYPE_COUNT) ? dtype_table[dt].name : "?";
}

int rs_dtype_from_safetensors(const char *s, rs_dtype *out) {
    for (int i = 0; i < RS_DTYPE_COUNT; i++) {
        if (strcmp(s, dtype_table[i].st_name) == 0) {
            *out = (rs_dtype)i;
            return RS_OK;
        }
    }
    return RS_EUNSUPPORTED;
}

int64_t rs_tensor_numel(const rs_tensor *t) {
    if (t->ndim == 0) return 0;
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

size_t rs_tensor_nbytes(const rs_tensor *t) {
    return (size_t)rs_tensor_numel(t) * rs_dtype_size(t->dtype);
}

uint16_t rs_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float rs_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: renormalize */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t rs_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65536: inf */
    if (a < 0x38800000u) {                                   /* below the smallest normal */
        /* value = a_float; f16 subnormal unit is 2^-24 */
        float af;
        memcpy(&af, &a, 4);
        float scaled = af * 16777216.0f; /* exact: power of two */
        /* round to nearest even in integer units */
        uint32_t q = (uint32_t)scaled;
        float rem = scaled - (float)q;
        if (rem > 0.5f || (rem == 0.5f && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}
