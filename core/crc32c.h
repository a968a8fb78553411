/*
 * crc32c.h — CRC-32C (Castagnoli, the iSCSI / ext4 / RFC 3720 checksum) of byte ranges, and the
 * combination of two ranges' CRCs into the CRC of their concatenation.
 *
 * The value is the standard one (reflected polynomial 0x82F63B78, initial value and final xor
 * 0xFFFFFFFF; "123456789" -> 0xE3069283), what Python's `crc32c` package, Google's crc32c and
 * Intel ISA-L compute. rs_crc32c runs ISA-L's crc32_iscsi (SSE4.2 where the CPU has it, chosen by
 * ISA-L at run time). rs_crc32c_combine makes it parallel: a weight update checksums each 128-row
 * band (or 1 MiB chunk) of a tensor on whichever thread converts it, and combines the bands in
 * order into the tensor's CRC, which is what a client computes over the whole tensor in one call.
 */
#ifndef RS_CRC32C_H
#define RS_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* CRC-32C of p[0, n) continuing from crc (0 for a fresh range): rs_crc32c(rs_crc32c(0, a, n), b, m)
 * is the CRC of a's n bytes followed by b's m. */
uint32_t rs_crc32c(uint32_t crc, const void *p, size_t n);

/* The same with ISA-L's baseline (table) code whatever the CPU: for tests of the dispatch. */
uint32_t rs_crc32c_base(uint32_t crc, const void *p, size_t n);

/* The CRC of A followed by B, from crc_a = CRC(A), crc_b = CRC(B) and B's length. */
uint32_t rs_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

#endif /* RS_CRC32C_H */
