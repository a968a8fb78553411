/*
 * tokenizer.h — a model directory's own tokenizer: text to token ids and back, exactly as Hugging
 * Face `tokenizers` (0.23) does it for the tokenizer.json in that directory.
 *
 * Supported (anything else in tokenizer.json is a load-time RS_EUNSUPPORTED naming its key path,
 * never an approximation):
 *   model          BPE (byte-level or not; unk_token, fuse_unk, byte_fallback, ignore_merges,
 *                  continuing_subword_prefix / end_of_word_suffix outside byte-level mode)
 *   normalizer     NFC, NFD, NFKC, NFKD (with tokenizers' Unicode 9.0 data), Replace, Prepend,
 *                  Sequence
 *   pre_tokenizer  Split (String or Regex pattern, every behavior, invert), ByteLevel (last in the
 *                  chain), Digits, Metaspace, Sequence
 *   post_processor TemplateProcessing, ByteLevel, Sequence
 *   decoder        ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence
 *   added_tokens   special, normalized, lstrip, rstrip, single_word, as AddedVocabulary matches them
 * Split patterns are Oniguruma's (Ruby syntax) and run on PCRE2 with Unicode 16.0 properties
 * (unicode.h says why); normalization forms come from utf8proc (normalize.c).
 *
 * From tokenizer_config.json (when present), as transformers 5 reads it: bos_token / eos_token,
 * split_special_tokens, and added_tokens_decoder (checked against tokenizer.json).
 * add_bos_token / add_eos_token change nothing: transformers 5 drops them when tokenizer.json
 * exists, so the file's post-processor alone adds special tokens. From generation_config.json:
 * eos_token_id (an int or a list) and bos_token_id.
 *
 * Thread safety: a loaded rs_tok is immutable (its BPE word cache locks itself); any number of
 * threads may encode and decode with it at once. A stream belongs to one thread at a time.
 */
#ifndef RS_TOKENIZER_H
#define RS_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/rs.h"

#define RS_TOK_MAX_EOS 16

typedef struct rs_tok rs_tok;

/* Loads DIR/tokenizer.json (+ DIR/tokenizer_config.json, DIR/generation_config.json when present).
 * RS_OK and *out (free with rs_tok_free). RS_ENOTFOUND when DIR has no tokenizer.json: not an
 * error for the daemon, which then serves token ids only (err says so). RS_EFORMAT for a corrupt
 * or inconsistent file, RS_EUNSUPPORTED for a component or option not implemented, RS_EIO; err
 * names the file and the key path ("pre_tokenizer.pretokenizers[1].type"). */
int rs_tok_load(const char *dir, rs_tok **out, rs_error *err);
/* The same from the bytes of a tokenizer.json alone (no config files); `name` labels messages. */
int rs_tok_load_json(const char *json, size_t len, const char *name, rs_tok **out, rs_error *err);
void rs_tok_free(rs_tok *t);

/* Encodes text[0,len) like Tokenizer.encode(text, add_special_tokens).ids. RS_OK with *ids
 * (malloc'd, free() it; NULL when *n is 0) and *n; RS_EINVAL when text is not valid UTF-8 (err
 * gives the byte offset; param left empty for the caller to name its field), or when a split
 * pattern exceeds PCRE2's backtracking limit on it (only pathological patterns; err says so). */
int rs_tok_encode(const rs_tok *t, const char *text, size_t len, bool add_special_tokens, int32_t **ids,
                  size_t *n, rs_error *err);

/* Tokenizer.decode(ids, skip_special_tokens): malloc'd NUL-terminated UTF-8 (free() it), its
 * length in *len if len is not NULL. Ids that name no token are skipped, as `tokenizers` does.
 * transformers' spaces_between_special_tokens has no effect on this (fast) kind of tokenizer, and
 * its clean_up_tokenization_spaces is skipped for BPE models, so neither is a parameter. */
char *rs_tok_decode(const rs_tok *t, const int32_t *ids, size_t n, bool skip_special_tokens, size_t *len);
/* The text of one token as SGLang puts it in logprob triples: decode([id]), special tokens kept
 * (a lone byte of a multi-byte character reads U+FFFD). malloc'd; "" for an unknown id. */
char *rs_tok_token_text(const rs_tok *t, int32_t id, size_t *len);

/* The vocabulary string of id (convert_ids_to_tokens), borrowed; NULL when no token has it. */
const char *rs_tok_id_to_token(const rs_tok *t, int32_t id, size_t *len);
/* The id of a vocabulary string (added tokens first, as token_to_id), or -1. */
int32_t rs_tok_token_to_id(const rs_tok *t, const char *tok, size_t len);

/* One past the largest token id (model vocabulary and added tokens). */
int32_t rs_tok_vocab_size(const rs_tok *t);
/* End-of-sequence ids: generation_config.json's eos_token_id, then tokenizer_config.json's
 * eos_token if different. Returns the count (0..RS_TOK_MAX_EOS) and the borrowed array. */
int rs_tok_eos_ids(const rs_tok *t, const int32_t **ids);
/* tokenizer_config.json's bos_token as an id, else generation_config.json's bos_token_id; -1. */
int32_t rs_tok_bos_id(const rs_tok *t);
/* Whether id is a special added token (skipped by skip_special_tokens). */
bool rs_tok_is_special(const rs_tok *t, int32_t id);
/* The tokenizer.json path it was loaded from. */
const char *rs_tok_path(const rs_tok *t);

/* ---- streaming detokenization ----
 * One stream per generated output. Each pushed id returns the text that has become final: bytes
 * that no later token can change. The concatenation of every delta of push and finish is exactly
 * rs_tok_decode(all ids pushed, skip_special_tokens); a delta never ends inside a UTF-8 character
 * (a character split across tokens is held until it completes, and ByteFallback byte runs, which
 * decode as a whole, until they end). The work per token is O(1) amortized: nothing already
 * emitted is decoded again. This is what HF's DecodeStream and vLLM's incremental detokenizer aim
 * at (they re-decode a window of prefix/read offsets); unlike them it is exact for every decoder
 * chain above and flushes what is held when the output ends. */
typedef struct rs_tok_stream rs_tok_stream;

rs_tok_stream *rs_tok_stream_new(const rs_tok *t, bool skip_special_tokens);
void rs_tok_stream_free(rs_tok_stream *s);
/* Feeds one id. Returns the delta's length and sets *delta to it (borrowed, valid until the next
 * call on s; NUL-terminated). */
size_t rs_tok_stream_push(rs_tok_stream *s, int32_t id, const char **delta);
/* Ends the output: returns the text still held (an incomplete character reads U+FFFD, as
 * decode does). The stream may not be pushed to afterwards. */
size_t rs_tok_stream_finish(rs_tok_stream *s, const char **delta);
/* What rs_tok_stream_finish would return now, without ending s: appended to the deltas so far it
 * makes decode(the ids pushed so far), what a re-decode of the output after this token reads (a
 * held byte run or incomplete character included). For stop strings, which must see that text as
 * soon as a re-decode would. Borrowed until the next call on s; O(what is held). */
size_t rs_tok_stream_peek_finish(rs_tok_stream *s, const char **text);
/* The bytes s holds (a ByteFallback run, an incomplete character, held trailing text): what a
 * peek costs. */
size_t rs_tok_stream_held_bytes(const rs_tok_stream *s);
/* Feeds ids that come before the output (the prompt's last few) and drops what they produce and
 * what they leave held: the output is then decoded as the continuation it is (a SentencePiece
 * Strip or Metaspace does not treat its first token as the start of the text), as SGLang's and
 * vLLM's detokenizers do by decoding after the prompt's tail. Call before the first push. */
void rs_tok_stream_prime(rs_tok_stream *s, const int32_t *ids, size_t n);

/* ---- stop strings on growing text ----
 * For a generation loop that appends deltas to text[0, len): */

/* The first stops[i] in list order (n_stops non-empty strings) that occurs in text[0,len) and ends
 * after `scanned` (text[0,scanned) was searched before; matches wholly inside it are not
 * reported again), as SGLang's check_finished and vLLM's check_stop_strings take the first stop
 * string of the request that the new text holds. Returns its index, with *pos the start of its
 * first such occurrence, or -1. */
int rs_tok_stop_find(const char *const *stops, const size_t *stop_lens, int n_stops, const char *text, size_t len,
                     size_t scanned, size_t *pos);
/* The length of the longest suffix of text[0,len) that is a proper prefix of some stop string:
 * that many trailing bytes may still become part of a match and should be held back from a
 * client. Never ends inside a UTF-8 character when text and stops are valid UTF-8. */
size_t rs_tok_stop_holdback(const char *const *stops, const size_t *stop_lens, int n_stops, const char *text,
                            size_t len);

/* ---- stop regular expressions on growing text ----
 * SGLang's `stop_regex`: an output stops once re.search(pattern, its text) finds a match. A
 * pattern is PCRE2 (UTF-8, Unicode properties for \d \w \s, as Python's `re` takes str patterns;
 * the two read the common syntax alike). Searching is incremental: every start position before
 * *from has failed for good, so each call costs the new bytes plus the tail that is still a
 * partial match. An rs_tok_stop_re holds its match data: one per request, used by one thread at a
 * time. */
typedef struct rs_tok_stop_re rs_tok_stop_re;

#define RS_TOK_STOP_RE_MATCH_LIMIT 100000u /* backtracking steps per search (about a millisecond) */

/* Compiles pat[0,len). RS_EINVAL naming `param`, with PCRE2's message and offset, when it does not
 * compile. */
int rs_tok_stop_re_compile(const char *pat, size_t len, const char *param, rs_tok_stop_re **out, rs_error *err);
void rs_tok_stop_re_free(rs_tok_stop_re *re);
const char *rs_tok_stop_re_pattern(const rs_tok_stop_re *re); /* NUL-terminated, as given */

/* Searches text[0,len) (valid UTF-8) for the leftmost match that starts at or after *from, taking
 * text as complete (so $ and lookaheads see its end). Returns 1 with [*ms, *me) the match; 0 when
 * there is none, with *from moved to the earliest start from which a match may still appear as
 * the text grows (len when none can); RS_ETOOBIG when the search exceeded
 * RS_TOK_STOP_RE_MATCH_LIMIT (*from unchanged), RS_EINTERNAL when text is not UTF-8. */
int rs_tok_stop_re_find(rs_tok_stop_re *re, const char *text, size_t len, size_t *from, size_t *ms, size_t *me);

/* ---- the default model's tokenizer ----
 * The tokenizer.json of the embedded default model (byte-level BPE, vocabulary 8192 with
 * <|endoftext|> = 2 as eos and <|begin_of_text|> = 1 as bos), built into the binary; the bytes
 * are NUL-terminated. */
const char *rs_tok_default_json(size_t *len);
/* Writes it as DIR/tokenizer.json and DIR/tokenizer_config.json. */
int rs_tok_write_default(const char *dir, rs_error *err);

#endif /* RS_TOKENIZER_H */
