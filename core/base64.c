/*
 * base64.c — standard base64 with padding (see base64.h).
 */
#include "base64.h"

static const char ALPHABET[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

void rs_base64_encode(const uint8_t *src, size_t n, char *out) {
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        const size_t left = n - i;
        const uint32_t x = (uint32_t)src[i] << 16 | (left > 1 ? (uint32_t)src[i + 1] << 8 : 0) |
                           (left > 2 ? (uint32_t)src[i + 2] : 0);
        out[o++] = ALPHABET[x >> 18 & 63];
        out[o++] = ALPHABET[x >> 12 & 63];
        out[o++] = left > 1 ? ALPHABET[x >> 6 & 63] : '=';
        out[o++] = left > 2 ? ALPHABET[x & 63] : '=';
    }
    out[o] = '\0';
}

static int value_of(char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

int rs_base64_decode_exact(const char *s, size_t len, uint8_t *out, size_t want) {
    if (len % 4 != 0) return -1;
    size_t n = 0;
    for (size_t i = 0; i < len; i += 4) {
        int v[4], pad = 0;
        for (int k = 0; k < 4; k++) {
            if (s[i + k] == '=' && i + 4 == len && k >= 2) {
                v[k] = 0;
                pad++;
            } else {
                if (pad) return -1; /* data after '=' */
                if ((v[k] = value_of(s[i + k])) < 0) return -1;
            }
        }
        uint32_t x = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        uint8_t b[3] = {(uint8_t)(x >> 16), (uint8_t)(x >> 8), (uint8_t)x};
        for (int k = 0; k < 3 - pad; k++) {
            if (n == want) return -1;
            out[n++] = b[k];
        }
    }
    return n == want ? 0 : -1;
}
