/*
 * unicode.h — the character-level facts the tokenizer needs, in one place: UTF-8 validation and
 * iteration, Rust's String::from_utf8_lossy, and Unicode 16.0 character properties (general
 * category, White_Space, numeric, word) from the generated table in unicode_data.c, plus the set
 * of code points assigned after Unicode 9.0.
 *
 * Why our own table: Hugging Face `tokenizers` decides these with Oniguruma and Rust's standard
 * library, both at Unicode 16.0 in the versions we match; Debian's PCRE2 (Unicode 14) is older,
 * and a code point assigned in between would otherwise split differently. Its normalizers are at
 * Unicode 9.0 (normalize.c). scripts/gen_unicode_tables.py says how the table is made.
 */
#ifndef RS_TOK_UNICODE_H
#define RS_TOK_UNICODE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* General categories, in the order of the table. */
typedef enum rs_uc_cat {
    RS_UC_Lu, RS_UC_Ll, RS_UC_Lt, RS_UC_Lm, RS_UC_Lo,
    RS_UC_Mn, RS_UC_Mc, RS_UC_Me,
    RS_UC_Nd, RS_UC_Nl, RS_UC_No,
    RS_UC_Pc, RS_UC_Pd, RS_UC_Ps, RS_UC_Pe, RS_UC_Pi, RS_UC_Pf, RS_UC_Po,
    RS_UC_Sm, RS_UC_Sc, RS_UC_Sk, RS_UC_So,
    RS_UC_Zs, RS_UC_Zl, RS_UC_Zp,
    RS_UC_Cc, RS_UC_Cf, RS_UC_Cs, RS_UC_Co, RS_UC_Cn,
    RS_UC_COUNT
} rs_uc_cat;

typedef struct rs_uc_range {
    uint32_t lo, hi; /* inclusive */
    uint8_t cat;     /* rs_uc_cat */
} rs_uc_range;

extern const char rs_uc_version[];
extern const rs_uc_range rs_uc_ranges[];
extern const size_t rs_uc_n_ranges;
extern const uint32_t rs_uc_post9[][2];
extern const size_t rs_uc_n_post9;

/* Bit set of categories: RS_UC_BIT(RS_UC_Lu) | ... */
#define RS_UC_BIT(c) (1u << (c))
#define RS_UC_MASK_L (RS_UC_BIT(RS_UC_Lu) | RS_UC_BIT(RS_UC_Ll) | RS_UC_BIT(RS_UC_Lt) | RS_UC_BIT(RS_UC_Lm) | RS_UC_BIT(RS_UC_Lo))
#define RS_UC_MASK_M (RS_UC_BIT(RS_UC_Mn) | RS_UC_BIT(RS_UC_Mc) | RS_UC_BIT(RS_UC_Me))
#define RS_UC_MASK_N (RS_UC_BIT(RS_UC_Nd) | RS_UC_BIT(RS_UC_Nl) | RS_UC_BIT(RS_UC_No))

rs_uc_cat rs_uc_category(uint32_t cp);
/* Unicode White_Space (what Oniguruma's and Rust regex's \s match). */
bool rs_uc_is_space(uint32_t cp);
/* Rust's char::is_numeric: categories Nd, Nl, No. */
bool rs_uc_is_numeric(uint32_t cp);
/* Rust regex's \w (UTS #18 word): Alphabetic, M, Nd, Pc, Join_Control. Alphabetic is L, Nl and
 * Other_Alphabetic; the Other_Alphabetic code points outside M are the circled, parenthesized and
 * squared Latin letters (So), listed in unicode.c. */
bool rs_uc_is_word(uint32_t cp);
/* Whether cp was assigned after Unicode 9.0 (what `tokenizers`' normalizers do not know). */
bool rs_uc_after_9(uint32_t cp);

/* ---- UTF-8 ---- */

/* Length of the valid UTF-8 prefix of s[0,n) (n when the whole is valid). */
size_t rs_utf8_valid_prefix(const char *s, size_t n);
/* Decodes the character at s[*i] (s valid UTF-8) and advances *i. */
uint32_t rs_utf8_next(const char *s, size_t *i);
/* Byte length of the character that starts with lead byte b (valid UTF-8). */
static inline int rs_utf8_len(unsigned char b) { return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4; }
/* Encodes cp (a scalar value) into out; returns the length (1..4). */
int rs_utf8_put(char out[4], uint32_t cp);

/* One step of String::from_utf8_lossy: the length of the valid character at s[0,n), or 0 when
 * the bytes there are invalid, in which case *bad is the length of the maximal invalid subpart
 * that becomes one U+FFFD (1..3; at the end of the input, an incomplete but valid prefix is
 * one subpart). n >= 1. */
size_t rs_utf8_lossy_step(const unsigned char *s, size_t n, size_t *bad);
/* True when s[0,n) (n in 1..3) is a proper prefix of some valid UTF-8 character, i.e. more bytes
 * could complete it. */
bool rs_utf8_incomplete(const unsigned char *s, size_t n);

#endif /* RS_TOK_UNICODE_H */
