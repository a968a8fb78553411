/*
 * base64.h — standard base64 with padding (RFC 4648 §4, Python's base64.b64encode), both ways.
 */
#ifndef RS_CORE_BASE64_H
#define RS_CORE_BASE64_H

#include <stddef.h>
#include <stdint.h>

/* Characters rs_base64_encode writes for n bytes, without the terminating NUL. */
static inline size_t rs_base64_len(size_t n) { return (n + 2) / 3 * 4; }

/* Writes the base64 of src[0, n) and a NUL to out, which holds rs_base64_len(n) + 1 bytes. */
void rs_base64_encode(const uint8_t *src, size_t n, char *out);

/* Decodes s[0, len) into exactly `want` bytes of out: 0, or -1 when s is not padded standard
 * base64 (length a multiple of 4, '=' only at the end) or decodes to another length. */
int rs_base64_decode_exact(const char *s, size_t len, uint8_t *out, size_t want);

#endif /* RS_CORE_BASE64_H */
