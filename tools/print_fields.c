/*
 * print_fields.c — prints the request-field reference (docs/api-fields.md) from the parsers'
 * descriptor tables:  build/print-fields > docs/api-fields.md
 */
#include <stdio.h>

#include "../protocol/fields_doc.h"

int main(void) {
    rs_protocol_print_fields(stdout);
    return fflush(stdout) == 0 ? 0 : 1;
}
