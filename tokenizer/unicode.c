/*
 * unicode.c — UTF-8 helpers and Unicode 16.0 character properties (see unicode.h).
 *
 * Lookups below U+10000 use a 64 KiB category table built once from the ranges; the rest use a
 * binary search over them (supplementary planes are rare in text and the table is sorted).
 */
#include "unicode.h"

#include <pthread.h>
#include <stdlib.h>

static uint8_t bmp_cat[0x10000];
static pthread_once_t bmp_once = PTHREAD_ONCE_INIT;

static void bmp_build(void) {
    for (size_t i = 0; i < 0x10000; i++) bmp_cat[i] = RS_UC_Cn;
    for (size_t r = 0; r < rs_uc_n_ranges && rs_uc_ranges[r].lo < 0x10000; r++) {
        uint32_t hi = rs_uc_ranges[r].hi < 0x10000 ? rs_uc_ranges[r].hi : 0xFFFF;
        for (uint32_t c = rs_uc_ranges[r].lo; c <= hi; c++) bmp_cat[c] = rs_uc_ranges[r].cat;
    }
}

rs_uc_cat rs_uc_category(uint32_t cp) {
    if (cp < 0x10000) {
        pthread_once(&bmp_once, bmp_build);
        return (rs_uc_cat)bmp_cat[cp];
    }
    size_t lo = 0, hi = rs_uc_n_ranges;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (rs_uc_ranges[mid].hi < cp) lo = mid + 1;
        else hi = mid;
    }
    if (lo < rs_uc_n_ranges && rs_uc_ranges[lo].lo <= cp) return (rs_uc_cat)rs_uc_ranges[lo].cat;
    return RS_UC_Cn;
}

bool rs_uc_is_space(uint32_t cp) {
    if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
    return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
           cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

bool rs_uc_is_numeric(uint32_t cp) {
    if (cp < 0x80) return cp >= '0' && cp <= '9';
    return (RS_UC_BIT(rs_uc_category(cp)) & RS_UC_MASK_N) != 0;
}

bool rs_uc_is_word(uint32_t cp) {
    if (cp < 0x80)
        return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || cp == '_';
    if (cp == 0x200C || cp == 0x200D) return true; /* Join_Control */
    if ((cp >= 0x24B6 && cp <= 0x24E9) || (cp >= 0x1F130 && cp <= 0x1F149) || (cp >= 0x1F150 && cp <= 0x1F169) ||
        (cp >= 0x1F170 && cp <= 0x1F189))
        return true; /* Other_Alphabetic symbols */
    uint32_t bit = RS_UC_BIT(rs_uc_category(cp));
    return (bit & (RS_UC_MASK_L | RS_UC_MASK_M | RS_UC_BIT(RS_UC_Nd) | RS_UC_BIT(RS_UC_Nl) | RS_UC_BIT(RS_UC_Pc))) != 0;
}

bool rs_uc_after_9(uint32_t cp) {
    if (cp < 0x560) return false; /* the first post-9.0 code point is U+0560 */
    size_t lo = 0, hi = rs_uc_n_post9;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (rs_uc_post9[mid][1] < cp) lo = mid + 1;
        else hi = mid;
    }
    return lo < rs_uc_n_post9 && rs_uc_post9[lo][0] <= cp;
}

/* ---- UTF-8 ---- */

/* The valid second-byte range for lead byte b (RFC 3629 table 3-7); lo > hi when b is no lead. */
static void second_range(unsigned char b, unsigned char *lo, unsigned char *hi) {
    *lo = 0x80, *hi = 0xBF;
    if (b == 0xE0) *lo = 0xA0;
    else if (b == 0xED) *hi = 0x9F;
    else if (b == 0xF0) *lo = 0x90;
    else if (b == 0xF4) *hi = 0x8F;
    else if (b < 0xC2 || b > 0xF4) *lo = 1, *hi = 0;
}

size_t rs_utf8_lossy_step(const unsigned char *s, size_t n, size_t *bad) {
    unsigned char b = s[0];
    if (b < 0x80) return 1;
    unsigned char lo, hi;
    second_range(b, &lo, &hi);
    if (lo > hi) {
        *bad = 1;
        return 0;
    }
    size_t need = b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
    for (size_t k = 1; k < need; k++) {
        if (k >= n) {
            *bad = k; /* an incomplete valid prefix at the end: one replacement */
            return 0;
        }
        unsigned char c = s[k];
        bool ok = k == 1 ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xBF);
        if (!ok) {
            *bad = k;
            return 0;
        }
    }
    return need;
}

bool rs_utf8_incomplete(const unsigned char *s, size_t n) {
    size_t bad = 0;
    return n >= 1 && n <= 3 && rs_utf8_lossy_step(s, n, &bad) == 0 && bad == n &&
           n < (size_t)(s[0] < 0xE0 ? 2 : s[0] < 0xF0 ? 3 : 4);
}

size_t rs_utf8_valid_prefix(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        size_t bad, k = rs_utf8_lossy_step(u + i, n - i, &bad);
        if (k == 0) return i;
        i += k;
    }
    return n;
}

uint32_t rs_utf8_next(const char *s, size_t *i) {
    const unsigned char *u = (const unsigned char *)s + *i;
    uint32_t c = u[0];
    if (c < 0x80) {
        *i += 1;
        return c;
    }
    if (c < 0xE0) {
        *i += 2;
        return ((c & 0x1F) << 6) | (u[1] & 0x3F);
    }
    if (c < 0xF0) {
        *i += 3;
        return ((c & 0x0F) << 12) | ((uint32_t)(u[1] & 0x3F) << 6) | (u[2] & 0x3F);
    }
    *i += 4;
    return ((c & 0x07) << 18) | ((uint32_t)(u[1] & 0x3F) << 12) | ((uint32_t)(u[2] & 0x3F) << 6) | (u[3] & 0x3F);
}

int rs_utf8_put(char out[4], uint32_t cp) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}
