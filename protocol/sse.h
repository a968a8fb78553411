/*
 * sse.h — Server-Sent Events framing, and the byte buffer that streamed (and other) responses are
 * built in.
 *
 * A streamed response is a sequence of events `data: <one JSON object>\n\n` ending with
 * `data: [DONE]\n\n`, as SGLang's /generate and OpenAI's /v1/completions send them. protocol/
 * writes every event (generate.h, openai.h); server/ only moves the bytes.
 */
#ifndef RS_PROTOCOL_SSE_H
#define RS_PROTOCOL_SSE_H

#include <stddef.h>

#include "../core/rs.h"

typedef struct rs_buf {
    char *data;                 /* [cap], NUL-terminated after len when non-NULL */
    size_t len, cap;
} rs_buf;

/* Appends n bytes. RS_OK or RS_ENOMEM (b unchanged). */
int rs_buf_append(rs_buf *b, const void *p, size_t n);
/* Drops the first n bytes (n <= len), keeping the memory. */
void rs_buf_consume(rs_buf *b, size_t n);
void rs_buf_free(rs_buf *b);   /* leaves b zeroed */

/* The terminating event, `data: [DONE]\n\n`. */
int rs_sse_done(rs_buf *b);

#endif /* RS_PROTOCOL_SSE_H */
