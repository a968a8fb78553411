/*
 * json_util.h — helpers shared by the protocol/ parsers and writers, and the walker that reads any
 * JSON object from its descriptor table. Private to protocol/: nothing outside it includes jansson.
 *
 * Parsing helpers name the offending field in the error (`param`) and quote the value in the
 * message; writers dump compact JSON with 9 significant digits, which round-trips an fp32 logprob.
 *
 * Descriptor tables. Every JSON object a route takes is one table of rs_jfield rows, in the
 * style of config/'s settings table: name, type, range, default, the neutral values of a field
 * rolloutd does not implement, the destination (which struct, offsetof) or a reader for composite
 * fields, and a doc string. rs_json_read walks an object against its table; it alone handles
 * duplicate keys (rejected when the body is loaded), unknown names, null (= absent = the default,
 * as in SGLang), wrong types, ranges and the refusal of unimplemented values, and every message
 * names the field and quotes the value. Fields are read in table order, not key order, so the
 * error a bad body gets does not depend on the order of its keys; a field read later may depend
 * on one read earlier (the table says which first). The same tables print the field reference
 * (fields_doc.h, docs/api-fields.md).
 *
 * What "known" means. A table lists every name that SGLang or vLLM/OpenAI define for that route
 * (the versions read are cited at the top of each protocol file), with one of three uses:
 *   RS_JU_READ       implemented: the value lands in its destination;
 *   RS_JU_NO_EFFECT  accepted with any value of its type, because nothing in rolloutd depends on
 *                    it (e.g. log_metrics: metrics are always kept);
 *   RS_JU_NEUTRAL    not implemented: null or one of `neutral` is accepted silently, anything
 *                    else is RS_EUNSUPPORTED naming the field and saying it is not implemented.
 * Any other name is RS_EINVAL "unknown field" (a typo must never be silently ignored); a row
 * with RS_JU_ELSEWHERE names a field of another API so that the error can say where it belongs.
 * Text fields (RS_JF_TOKENIZER) are rows like the others; their readers answer a 400 saying why
 * when the model has no tokenizer.json.
 */
#ifndef RS_PROTOCOL_JSON_UTIL_H
#define RS_PROTOCOL_JSON_UTIL_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "../core/rs.h"
#include "../scheduler/engine.h"
#include "../tokenizer/tokenizer.h"
#include "gen_text.h"
#include "sse.h"

#define RS_JSON_DUMP_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(9))

/* ---------------------------------------------------------------- descriptor tables */

typedef enum rs_jtype {
    RS_JT_BOOL = 0,     /* bool */
    RS_JT_INT,          /* int (size 4) or long long (size 8), an integer in [min, max] */
    RS_JT_FLOAT,        /* float (size 4) or double (size 8): a number in [min, max] (see the RS_JF_*_OPEN flags) */
    RS_JT_STRING,       /* char[size]: 1..size-1 bytes, no control characters */
    RS_JT_ENUM,         /* int: the index of the value in `choices` ("a|b|c") */
    RS_JT_IDS,          /* int32_t * (owned, freed first) at offset; its count (int) at offset2 */
    RS_JT_OBJECT,       /* a nested object, read by the table `sub` into the same destinations */
    RS_JT_CUSTOM,       /* read(): a composite field; `sub` (optional) documents its inner object */
    /* shapes of fields whose value rolloutd only checks */
    RS_JT_NUMBER,       /* any number */
    RS_JT_TEXT,         /* a string */
    RS_JT_LIST,         /* a list */
    RS_JT_MAP,          /* an object */
    RS_JT_STRINGS,      /* a string or a list of strings */
    RS_JT_ANY,          /* any value */
} rs_jtype;

typedef enum rs_juse {
    RS_JU_READ = 0,     /* implemented */
    RS_JU_NO_EFFECT,    /* accepted with any value of its type; rolloutd does not depend on it */
    RS_JU_NEUTRAL,      /* not implemented: null or `neutral` accepted, else RS_EUNSUPPORTED */
    RS_JU_ELSEWHERE,    /* not a field of this object: "unknown field" with the row's doc as a hint */
} rs_juse;

enum {
    RS_JF_REQUIRED = 1u << 0,   /* absent or null: "<field> is required" */
    RS_JF_MIN_OPEN = 1u << 1,   /* FLOAT: value > min (else >= min) */
    RS_JF_MAX_OPEN = 1u << 2,   /* FLOAT: value < max (else <= max) */
    RS_JF_NOT_ZERO = 1u << 3,   /* INT: 0 is refused ("-1 (off) or >= 1") */
    RS_JF_ZERO_OFF = 1u << 4,   /* INT: 0 is stored as -1 (vLLM's top_k) */
    RS_JF_READ_NULL = 1u << 5,  /* CUSTOM: read() also sees an explicit null (a JSON null value) */
    RS_JF_TOKENIZER = 1u << 6,  /* a text field: needs the model's tokenizer.json (docs say so) */
};

typedef struct rs_jfield rs_jfield;
typedef struct rs_jobject rs_jobject;

/* A server limit that bounds a field beyond its table's range (checked after parsing, against the
 * server's settings: rs_gen_job_validate), named by the row so that the server's JSON Schema can
 * state it (rs_json_schema with rs_jlimits). */
typedef enum rs_jlimit {
    RS_JL_NONE,
    RS_JL_NEW_TOKENS,           /* --max-new-tokens */
    RS_JL_N,                    /* --max-n */
    RS_JL_TOP_LOGPROBS,         /* --max-top-logprobs */
    RS_JL_COUNT
} rs_jlimit;

/* The values of those limits for one server, and its vocabulary: every token id is below it. */
typedef struct rs_jlimits {
    long long max[RS_JL_COUNT]; /* by rs_jlimit (max[RS_JL_NONE] unused) */
    long long vocab;
} rs_jlimits;

/* What a custom reader gets: the destinations and the field as errors name it. */
typedef struct rs_jctx {
    void *const *dst;           /* destination structs, indexed by rs_jfield.base */
    const rs_jfield *f;
    const char *param;          /* "sampling_params.top_p", "tensors[3].shape" */
} rs_jctx;
typedef int (*rs_jread_fn)(const rs_jctx *c, const json_t *v, rs_error *err);

struct rs_jfield {
    const char *name;
    rs_jtype type;
    rs_juse use;
    unsigned flags;             /* RS_JF_* */
    int base;                   /* which destination struct (READ) */
    size_t offset, offset2;     /* destination in dst[base] (offset2: IDS count) */
    size_t size;                /* of the destination (INT, FLOAT: its width; STRING: buffer bytes) */
    double min, max;            /* INT, FLOAT: inclusive range (see the OPEN flags) */
    const char *choices;        /* ENUM: "a|b|c" */
    const char *neutral;        /* NEUTRAL: JSON values accepted besides null, "|"-separated: true,
                                 * false, numbers, "" (the empty string), [] and {} */
    const char *def;            /* the default as the docs show it (READ: the destination's initial value) */
    rs_jread_fn read;           /* CUSTOM */
    const char *shape;          /* CUSTOM: its JSON shape as the docs show it ("string or list of strings") */
    const char *schema;         /* CUSTOM: the JSON Schema of its value (null aside: it is added
                                 * where the field is not required), as JSON written with ' for ",
                                 * in which the strings '$sub' (the schema of `sub`), '$ids' (a list of
                                 * token ids, below rs_jlimits.vocab where the schema is given one;
                                 * '$ids1': not empty) and '$name' (the pattern of a string
                                 * without control characters) stand for what they name; every
                                 * CUSTOM row has one */
    rs_jlimit limit;            /* INT, or a CUSTOM integer: the server limit that caps it too */
    const rs_jobject *sub;      /* OBJECT (and a CUSTOM field's inner object, for docs) */
    const char *doc;            /* what it does; for NEUTRAL, why it is not implemented */
};

struct rs_jobject {
    const char *title;          /* as the docs head it: "POST /generate" */
    const rs_jfield *fields;
    size_t n;
    const char *unknown_hint;   /* appended to every "unknown field" message, or NULL */
    const char *one_of;         /* "a|b": fields of which exactly one must be given (the parser says
                                 * so), for the schema (rs_json_schema), or NULL */
    const char *schema_also;    /* keywords the object's schema adds for a rule between fields that
                                 * the parser checks (JSON written with ' for "), or NULL */
};

#define RS_JOBJECT_MAX_FIELDS 128

/* Reads obj by table t into dst[]. prefix names obj in messages ("" at the top level,
 * "sampling_params", "tensors[3]"). Destinations not in obj keep their values (the caller's
 * defaults). RS_OK, or RS_EINVAL / RS_EUNSUPPORTED / RS_ENOMEM with err naming the field; the
 * destinations may then be partly filled (the caller frees them as on success). */
int rs_json_read(const json_t *obj, const rs_jobject *t, void *const *dst, const char *prefix, rs_error *err);

/* The destination of the field a custom reader reads (dst[f->base] + f->offset). */
void *rs_json_dst(const rs_jctx *c);
/* Checks v (not null) against a type's JSON shape, naming param in the error. */
int rs_json_check_type(rs_jtype type, const json_t *v, const char *param, rs_error *err);
/* True when v is one of the "|"-separated JSON values of `neutral` (see rs_jfield). */
bool rs_json_neutral(const json_t *v, const char *neutral);
/* The RS_EUNSUPPORTED error of a NEUTRAL field given another value. */
int rs_json_not_implemented(rs_error *err, const char *param, const rs_jfield *f, const json_t *v);

/* Parses a whole body as one JSON object (duplicate keys rejected). An empty body is an error
 * unless allow_empty, in which case *out is a new empty object. */
int rs_json_load_object(const char *body, size_t len, bool allow_empty, json_t **out, rs_error *err);

/* A JSON value as a message shows it: numbers and literals by value, containers by kind. */
void rs_json_describe(const json_t *v, char *buf, size_t n);
int rs_json_bad_type(rs_error *err, const char *param, const char *want, const json_t *v);
/* True when v is an integer as JSON Schema counts one: 16, and also a real with no fractional
 * part (16.0, 1.6e1), which pydantic (vLLM's request models) and Python (SGLang's) take for an
 * int too; 16.5 is not. */
bool rs_json_is_int(const json_t *v);
/* An integer (rs_json_is_int) in [min, max]. */
int rs_json_get_int(const json_t *v, const char *param, long long min, long long max, long long *out,
                    rs_error *err);
/* Any finite number that fits a float. */
int rs_json_get_float(const json_t *v, const char *param, double *out, rs_error *err);
int rs_json_get_bool(const json_t *v, const char *param, bool *out, rs_error *err);
/* A list of non-negative int32 token ids into a new array (NULL when empty). `path` is how
 * messages name the list. */
int rs_json_get_ids(const json_t *arr, const char *param, const char *path, int32_t **out, int *n_out,
                    rs_error *err);
/* The prompt(s) of a generation request into job (prompts, prompt_lens, n_prompts, batched): a
 * non-empty list of token ids, or a non-empty list of non-empty such lists (a batch). `param`
 * names the list ("input_ids", "prompt"); prompt p is "<param>[p]". */
int rs_json_get_prompts(const json_t *v, const char *param, rs_gen_job *job, rs_error *err);
/* Text prompt(s) into job, encoded with tok (not NULL): a non-empty string, or a non-empty list of
 * them (a batch, like a list of lists of ids). An empty prompt is RS_EINVAL naming it
 * ("text[1] must not be empty"). */
int rs_json_get_text_prompts(const json_t *v, const char *param, const rs_tok *tok, bool add_special,
                             rs_gen_job *job, rs_error *err);
/* Stop strings, or with `regex` stop regexes (a string or a list of strings; "" entries ignored),
 * into t. */
int rs_json_read_stops(const json_t *v, const char *param, rs_gen_text *t, bool regex, rs_error *err);
/* The text of token id (rs_tok_token_text) as a JSON string. */
json_t *rs_json_token_text(const rs_tok *tok, int32_t id);
/* A non-empty printable string of at most max_len bytes, without control characters. */
int rs_json_check_name(const json_t *v, const char *param, size_t max_len, rs_error *err);

/* Markdown for table t (and, after it, every nested table it reaches): one row per field with its
 * JSON type and range, default, status and doc. */
void rs_json_print_table(FILE *f, const rs_jobject *t);

/* JSON written with ' for " (schemas in C source), parsed: a constant, so text that does not parse
 * is a bug (asserted). New reference. */
json_t *rs_json_quoted(const char *text);

/* The JSON Schema (2020-12, as OpenAPI 3.1 takes it) of an object that table t reads: every
 * field's type and range as the walker checks it, null for the fields that are not required, a
 * NEUTRAL field's accepted values as an enum, `required`, and no other property
 * (additionalProperties false). With lim (may be NULL: the tables' ranges alone), a row's limit
 * lowers its maximum and token ids are below lim->vocab, as the server checks them. New
 * reference, or NULL when memory is exhausted. */
json_t *rs_json_schema(const rs_jobject *t, const rs_jlimits *lim);

/* A JSON string of s; text that is not valid UTF-8 keeps its ASCII and has every other byte
 * replaced by '?' (messages quote request bytes, paths are bytes). */
json_t *rs_json_string_lossy(const char *s);

/* A logprob as JSON: null when it is not finite (no context, or -inf). */
json_t *rs_json_logprob(float lp);

/* Steals v: dumps it as compact text (new malloc'd string, *len set), or NULL on OOM. */
char *rs_json_dump(json_t *v, size_t *len);
/* Steals v: appends `data: <json>\n\n` to b. RS_OK or RS_ENOMEM. */
int rs_json_sse_event(rs_buf *b, json_t *v);
/* Appends v's compact text to b (v is borrowed). */
int rs_json_append(rs_buf *b, const json_t *v);

#endif /* RS_PROTOCOL_JSON_UTIL_H */
