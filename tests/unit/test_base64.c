/*
 * test_base64.c — core/base64.h against RFC 4648's test vectors (§10) and Python's
 * base64.b64encode of binary bytes, both ways, and what decoding refuses.
 */
#include <string.h>

#include "../../core/base64.h"
#include "test.h"

RS_TEST(base64_rfc4648_vectors_both_ways) {
    static const char *plain[] = {"", "f", "fo", "foo", "foob", "fooba", "foobar"};
    static const char *coded[] = {"", "Zg==", "Zm8=", "Zm9v", "Zm9vYg==", "Zm9vYmE=", "Zm9vYmFy"};
    for (int i = 0; i < 7; i++) {
        char out[16];
        const size_t n = strlen(plain[i]);
        ASSERT_EQ(rs_base64_len(n), strlen(coded[i]));
        rs_base64_encode((const uint8_t *)plain[i], n, out);
        ASSERT_STREQ(out, coded[i]);
        uint8_t back[8] = {0};
        ASSERT_EQ(rs_base64_decode_exact(coded[i], strlen(coded[i]), back, n), 0);
        ASSERT_TRUE(memcmp(back, plain[i], n) == 0);
    }
    /* base64.b64encode(bytes([0, 1, 254, 255, 128, 127, 62, 63])) and little-endian int32 [1, -1] */
    static const uint8_t bin[] = {0, 1, 254, 255, 128, 127, 62, 63};
    char out[32];
    rs_base64_encode(bin, sizeof bin, out);
    ASSERT_STREQ(out, "AAH+/4B/Pj8=");
    static const uint8_t ints[] = {1, 0, 0, 0, 255, 255, 255, 255};
    rs_base64_encode(ints, sizeof ints, out);
    ASSERT_STREQ(out, "AQAAAP////8=");
}

RS_TEST(base64_decode_refuses_malformed) {
    uint8_t out[8];
    ASSERT_EQ(rs_base64_decode_exact("Zm9", 3, out, 2), -1);      /* not a multiple of 4 */
    ASSERT_EQ(rs_base64_decode_exact("Zm=v", 4, out, 2), -1);     /* data after '=' */
    ASSERT_EQ(rs_base64_decode_exact("Zm9v", 4, out, 2), -1);     /* decodes to 3 bytes, not 2 */
    ASSERT_EQ(rs_base64_decode_exact("Zm9*", 4, out, 3), -1);     /* not the alphabet */
    ASSERT_EQ(rs_base64_decode_exact("Zg==Zg==", 8, out, 2), -1); /* padding in the middle */
}
