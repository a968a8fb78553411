/*
 * sse.c — the byte buffer and SSE framing (see sse.h).
 */
#include "sse.h"

#include <stdlib.h>
#include <string.h>

int rs_buf_append(rs_buf *b, const void *p, size_t n) {
    if (n > SIZE_MAX - b->len - 1) return RS_ENOMEM;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap = cap > SIZE_MAX / 2 ? b->len + n + 1 : cap * 2;
        char *q = realloc(b->data, cap);
        if (!q) return RS_ENOMEM;
        b->data = q;
        b->cap = cap;
    }
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = '\0';
    return RS_OK;
}

void rs_buf_consume(rs_buf *b, size_t n) {
    RS_ASSERT(n <= b->len);
    if (n == b->len) {
        b->len = 0;
    } else {
        memmove(b->data, b->data + n, b->len - n);
        b->len -= n;
    }
    if (b->data) b->data[b->len] = '\0';
}

void rs_buf_free(rs_buf *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}

int rs_sse_done(rs_buf *b) {
    static const char done[] = "data: [DONE]\n\n";
    return rs_buf_append(b, done, sizeof done - 1);
}
