/*
 * fields_doc.h — the field reference of every request body, printed from the descriptor tables
 * the parsers read them with (json_util.h), so the documentation cannot drift from the code.
 *
 * tools/print_fields.c prints it; docs/api-fields.md is its output (a test compares the two).
 */
#ifndef RS_PROTOCOL_FIELDS_DOC_H
#define RS_PROTOCOL_FIELDS_DOC_H

#include <stddef.h>
#include <stdio.h>

/* Every route's body table (json_util.h's rs_jobject), in the order the reference lists them. */
struct rs_jobject;
const struct rs_jobject *const *rs_protocol_tables(size_t *n);

/* Markdown: an introduction, then one table per JSON object of every route that takes a body. */
void rs_protocol_print_fields(FILE *out);

#endif /* RS_PROTOCOL_FIELDS_DOC_H */
