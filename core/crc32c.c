/*
 * crc32c.c — CRC-32C through ISA-L, and the combination of CRCs (see crc32c.h).
 *
 * ISA-L's crc32_iscsi takes and returns the register without the final inversion and an int
 * length, so a range is fed in pieces of at most 1 GiB between one inversion in and one out.
 *
 * Combination. Over GF(2), the CRC register after A||B is the register after A shifted through
 * len(B) zero bytes, xor the register after B alone (the pre/post inversions cancel in the xor,
 * as in zlib's crc32_combine). Shifting by n bytes is a multiplication by x^(8n) modulo the
 * polynomial; x^(2^k) for k < 67 (8 x a 64-bit length) is tabulated once (squaring), so a
 * combination costs at most 64 multiplications of 32 steps each, whatever the length.
 */
#include "crc32c.h"

#include <isa-l/crc.h>
#include <pthread.h>

#define POLY 0x82f63b78u /* reflected Castagnoli polynomial: bit 31 is x^0 */

static uint32_t feed(unsigned int (*fn)(unsigned char *, int, unsigned int), uint32_t crc, const void *p, size_t n) {
    uint32_t r = ~crc;
    const unsigned char *b = p;
    while (n > 0) {
        const size_t k = n < ((size_t)1 << 30) ? n : ((size_t)1 << 30);
        r = fn((unsigned char *)b, (int)k, r); /* ISA-L only reads the buffer */
        b += k;
        n -= k;
    }
    return ~r;
}

uint32_t rs_crc32c(uint32_t crc, const void *p, size_t n) { return feed(crc32_iscsi, crc, p, n); }
uint32_t rs_crc32c_base(uint32_t crc, const void *p, size_t n) { return feed(crc32_iscsi_base, crc, p, n); }

/* a * b mod POLY, both reflected (bit 31 = x^0). */
static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

static uint32_t x2n_table[67]; /* x^(2^k) mod POLY */
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void table_init(void) {
    uint32_t p = 1u << 30; /* x^1 */
    x2n_table[0] = p;
    for (int k = 1; k < 67; k++) x2n_table[k] = p = multmodp(p, p);
}

uint32_t rs_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
    pthread_once(&table_once, table_init);
    uint32_t p = 1u << 31; /* x^0 */
    for (int k = 3; len_b; len_b >>= 1, k++) /* x^(8 len_b): the product of x^(2^k) over len_b's bits */
        if (len_b & 1) p = multmodp(x2n_table[k], p);
    return multmodp(p, crc_a) ^ crc_b;
}
