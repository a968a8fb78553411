"""rolloutd's tokenizer (through build/tokenize) against Hugging Face `tokenizers`, live.

For each committed tokenizer (tests/fixtures/tokenizers/*, scripts/make_tokenizers.py) and the
default model's, at least 10,000 strings with a fixed seed: the corpus lines, random Unicode strings
over all planes (valid scalar values), random bytes cut to valid UTF-8, and added/special tokens
embedded in text; each with add_special_tokens on and off. Ids must be identical; decode (with and
without skip_special_tokens) must equal `tokenizers`' decode; decode(encode(s)) == s wherever
`tokenizers` round-trips; the streaming decoder's deltas (checked by the tool to be valid UTF-8)
must concatenate to decode, for the encoded ids and for random id sequences. Pipeline variants
(other normalizers, Split behaviors, Digits, ByteLevel with its regex, Metaspace schemes, added
tokens with lstrip/rstrip/single_word/normalized) are built from the fixtures' vocabularies and
checked the same way on fewer strings.

Needs only the `tokenizers` wheel (scripts/install-deps.sh installs it); skips, saying why, without it
or without build/tokenize. RS_TOKENIZER_CASES scales the number of strings (below the corpus's
3,194 lines, a sample of them makes up two thirds; the variants' line sample and the random id
sequences are a third of it, at most 1,000).
"""
import json
import os
import pathlib
import random
import subprocess

import pytest

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
tokenizers = pytest.importorskip("tokenizers", reason="the `tokenizers` package is the reference (pip install tokenizers)")
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "tokenizers"
BIN_DIR = pathlib.Path(os.environ.get("ROLLOUTD_BIN", str(ROOT / "build" / "rolloutd"))).parent
TOOL = BIN_DIR / "tokenize" if (BIN_DIR / "tokenize").exists() else ROOT / "build" / "tokenize"
CASES = int(os.environ.get("RS_TOKENIZER_CASES", "10000"))
SOME = min(1000, CASES // 3)  # lines per variant, random id sequences per check
FIXTURES = ["qwen2", "llama3", "spm", "spm_metaspace"]

if not TOOL.exists():
    pytest.skip(f"{TOOL} is not built (make all)", allow_module_level=True)


def random_scalar(rng):
    """A random Unicode scalar value, every plane equally likely, surrogates excluded."""
    while True:
        plane = rng.choice([0, 0, 0, 1, 2, 3, 14, 15, 16] + list(range(4, 14)))
        c = plane * 0x10000 + rng.randrange(0x10000)
        if not 0xD800 <= c <= 0xDFFF:
            return chr(c)


def random_strings(rng, lines, specials, n):
    out = []
    pieces = ["", " ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "'s", "'LL", "123", "4567890", "é", "e\u0301",
              "👨‍👩‍👧", "🇯🇵", "中文", "مرحبا", "ſ", "K", "İ"]
    while len(out) < n:
        kind = len(out) % 5
        if kind == 0:
            s = "".join(random_scalar(rng) for _ in range(rng.randint(0, 24)))
        elif kind == 1:  # random bytes, cut to valid UTF-8
            b = bytes(rng.randrange(256) for _ in range(rng.randint(0, 48)))
            s = b.decode("utf-8", errors="ignore")
        elif kind == 2:  # corpus text with specials and odd pieces spliced in
            s = rng.choice(lines)
            for _ in range(rng.randint(1, 4)):
                at = rng.randint(0, len(s))
                s = s[:at] + rng.choice(specials + pieces) + s[at:]
        elif kind == 3:  # short mixes of everything
            s = "".join(rng.choice(pieces + specials + [random_scalar(rng), rng.choice(lines)[:8]])
                        for _ in range(rng.randint(1, 8)))
        else:
            s = rng.choice(lines)
        out.append(s)
    return out


class CTok:
    """build/tokenize on a directory or a tokenizer.json, fed JSON lines in one batch."""

    def __init__(self, path):
        self.path = str(path)

    def run(self, reqs):
        inp = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in reqs)
        p = subprocess.run([str(TOOL), self.path], input=inp.encode(), capture_output=True, timeout=600)
        lines = p.stdout.decode().split("\n")[:-1]
        if lines and "load_error" in json.loads(lines[0]):
            raise AssertionError(json.loads(lines[0]))
        assert p.returncode == 0, p.stderr.decode()[-2000:]
        assert len(lines) == len(reqs), p.stderr.decode()[-2000:]
        return [json.loads(x) for x in lines]


def corpus():
    return [json.loads(x) for x in (FIX / "corpus.txt").read_text().splitlines()]


def special_strings(tok):
    return [t.content for t in tok.get_added_tokens_decoder().values()]


def hf_decode(ref, ids, skip):
    """tokenizers' decode, or None where it panics (Strip with stop > 0 on an empty string)."""
    try:
        return ref.decode(ids, skip_special_tokens=skip)
    except BaseException as e:
        assert "PanicException" in type(e).__name__, e
        return None


def roundtrip_all(ref, ctok, texts):
    enc = ctok.run([{"op": "encode", "text": s, "special": False} for s in texts])
    dec = ctok.run([{"op": "decode", "ids": e["ids"], "skip": False} for e in enc])
    n = 0
    for s, d in zip(texts, dec):
        if hf_decode(ref, ref.encode(s, add_special_tokens=False).ids, False) == s:
            assert d["text"] == s, f"round trip of {s!r}: {d['text']!r}"
            n += 1
    return n


@pytest.mark.parametrize("name", FIXTURES + ["default"])
def test_matches_tokenizers(name, tmp_path):
    if name == "default":
        d = tmp_path / "default"
        d.mkdir()
        (d / "tokenizer.json").write_bytes((ROOT / "tokenizer" / "default_tokenizer.json").read_bytes())
    else:
        d = FIX / name
    ref = Tokenizer.from_file(str(d / "tokenizer.json"))
    ctok = CTok(d)
    rng = random.Random(1500 + len(name))
    lines = corpus()
    if CASES < len(lines):
        lines = rng.sample(lines, CASES - CASES // 3)
    texts = lines + random_strings(rng, lines, special_strings(ref), max(CASES - len(lines), CASES // 3))
    assert len(texts) >= CASES
    n = check_fast(ref, ctok, texts, rng)
    assert n >= CASES
    assert roundtrip_all(ref, ctok, texts) > len(texts) // 2


def check_fast(ref, ctok, texts, rng):
    """check() without the per-string round trip (roundtrip_all does those in one batch)."""
    reqs = [{"op": "encode", "text": s, "special": sp} for s in texts for sp in (False, True)]
    got = ctok.run(reqs)
    want = [ref.encode(s, add_special_tokens=sp).ids for s in texts for sp in (False, True)]
    bad = [(r["text"], r["special"], g.get("ids", g), w) for r, g, w in zip(reqs, got, want) if g.get("ids") != w]
    assert not bad, f"{len(bad)} of {len(reqs)} encodes differ, first: {bad[0]!r}"
    ids_list = want[1::2]
    vocab = ref.get_vocab_size()
    for _ in range(SOME):
        ids_list.append([rng.randrange(vocab) for _ in range(rng.randint(0, 12))])
    reqs = [{"op": op, "ids": ids, "skip": skip} for ids in ids_list for skip in (False, True) for op in ("decode", "stream")]
    got = ctok.run(reqs)
    for r, g in zip(reqs, got):
        if r["op"] == "decode":
            w = hf_decode(ref, r["ids"], r["skip"])
            if w is None:
                continue
            assert g.get("text") == w, f"decode({r['ids']}, skip={r['skip']}): {g!r} != {w!r}"
        else:
            assert "deltas" in g, f"stream({r['ids']}, skip={r['skip']}): {g}"
    return len(texts)


def test_token_text_is_decode_of_one_id():
    for name in FIXTURES:
        ref = Tokenizer.from_file(str(FIX / name / "tokenizer.json"))
        ctok = CTok(FIX / name)
        ids = list(range(ref.get_vocab_size()))
        got = ctok.run([{"op": "token_text", "id": i} for i in ids])
        for i, g in zip(ids, got):
            assert g["text"] == ref.decode([i], skip_special_tokens=False), (name, i, g)


def test_invalid_utf8_is_an_error():
    ctok = CTok(FIX / "qwen2")
    got = ctok.run([{"op": "encode", "hex": h, "special": True} for h in ["ff", "6162c3", "c0af", "eda080", "f4908080", "e282"]])
    for g in got:
        assert g.get("code") == "RS_EINVAL" and "UTF-8" in g["error"], g
    assert ctok.run([{"op": "encode", "hex": "61e282ac62"}])[0]["ids"] == Tokenizer.from_file(
        str(FIX / "qwen2" / "tokenizer.json")).encode("a€b", add_special_tokens=False).ids


# ---- pipeline variants, built from the fixtures' vocabularies ----

def variant(base, tmp_path, name, edit):
    tok = Tokenizer.from_file(str(FIX / base / "tokenizer.json"))
    edit(tok)
    d = tmp_path / name
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    return d


def split_seq(*splits):
    return pre_tokenizers.Sequence(list(splits) + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


BYTE_LEVEL_VARIANTS = {
    "gpt2": lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)),
    "bytelevel_noprefix": lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "bytelevel_plain": lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)),
    "nfd": lambda t: setattr(t, "normalizer", normalizers.NFD()),
    "nfkc": lambda t: setattr(t, "normalizer", normalizers.Sequence([normalizers.NFKC(), normalizers.NFC()])),
    "nfkd": lambda t: setattr(t, "normalizer", normalizers.NFKD()),
    "replace_regex": lambda t: setattr(t, "normalizer", normalizers.Sequence([
        normalizers.Replace(Regex(r"\s+"), " "), normalizers.Replace("ab", "X"), normalizers.Prepend("^")])),
    "split_removed": lambda t: setattr(t, "pre_tokenizer", split_seq(pre_tokenizers.Split(Regex(r"\s+"), "removed"))),
    "split_prev": lambda t: setattr(t, "pre_tokenizer", split_seq(pre_tokenizers.Split(Regex(r"\p{P}+"), "merged_with_previous"))),
    "split_next": lambda t: setattr(t, "pre_tokenizer", split_seq(pre_tokenizers.Split(Regex(r"[\p{Z}\t]"), "merged_with_next"))),
    "split_contig": lambda t: setattr(t, "pre_tokenizer", split_seq(pre_tokenizers.Split(Regex(r"\d"), "contiguous"))),
    "split_invert": lambda t: setattr(t, "pre_tokenizer", split_seq(pre_tokenizers.Split(Regex(r"\p{L}+|\p{N}"), "isolated", invert=True))),
    "split_string": lambda t: setattr(t, "pre_tokenizer", split_seq(pre_tokenizers.Split(", ", "merged_with_next"),
                                                                    pre_tokenizers.Split(".", "removed"))),
    "split_empty_matches": lambda t: setattr(t, "pre_tokenizer", split_seq(pre_tokenizers.Split(Regex(r"a*|(?=x)"), "merged_with_previous"),
                                                                           pre_tokenizers.Split(Regex(r"^\s*|\s*$"), "contiguous"))),
    "split_anchors": lambda t: setattr(t, "pre_tokenizer", split_seq(pre_tokenizers.Split(Regex(r"(?m:^.)|\n$|[\u0300-\u036f]{,2}"), "isolated"))),
    "deepseek": lambda t: setattr(t, "pre_tokenizer", split_seq(  # DeepSeek-V3's splits
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), "isolated"),
        pre_tokenizers.Split(Regex("[一-龥\u3040-ゟ゠-ヿ]+"), "isolated"),
        pre_tokenizers.Split(Regex(r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""), "isolated"))),
    "digits": lambda t: setattr(t, "pre_tokenizer", split_seq(pre_tokenizers.Digits(individual_digits=True))),
    "digits_runs": lambda t: setattr(t, "pre_tokenizer", split_seq(pre_tokenizers.Digits(individual_digits=False),
                                                                   pre_tokenizers.Split(Regex(r"\h+|\d{2}|\S\s"), "isolated"))),
}


def add_flagged_tokens(t):
    t.add_tokens([AddedToken("<mask>", lstrip=True, rstrip=False, single_word=False, normalized=False),
                  AddedToken("[SEP]", lstrip=False, rstrip=True, single_word=False, normalized=False),
                  AddedToken("word", single_word=True, normalized=False),
                  AddedToken("Été", normalized=True),
                  AddedToken("ﬁne", normalized=True, single_word=True),
                  AddedToken(" spaced ", lstrip=True, rstrip=True, normalized=False)])
    t.add_special_tokens([AddedToken("<|sp|>", lstrip=True, rstrip=True, normalized=False)])


SPM_VARIANTS = {
    "meta_always": lambda t: (setattr(t, "normalizer", None),
                              setattr(t, "pre_tokenizer", pre_tokenizers.Metaspace(prepend_scheme="always", split=True)),
                              setattr(t, "decoder", decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="always")]))),
    "meta_never": lambda t: (setattr(t, "normalizer", None),
                             setattr(t, "pre_tokenizer", pre_tokenizers.Metaspace(prepend_scheme="never", split=True)),
                             setattr(t, "decoder", decoders.Metaspace(prepend_scheme="never"))),
    "meta_first_split": lambda t: (setattr(t, "normalizer", None),
                                   setattr(t, "pre_tokenizer", pre_tokenizers.Metaspace(prepend_scheme="first", split=True)),
                                   setattr(t, "decoder", decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                                                            decoders.Fuse(), decoders.Strip(" ", 1, 1)]))),
    "spm_nodecoder": lambda t: setattr(t, "decoder", None),
    "spm_fuse_replace": lambda t: setattr(t, "decoder", decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(),
                                                                           decoders.Replace("▁", " "), decoders.Replace("ab", "Z"),
                                                                           decoders.Metaspace(prepend_scheme="first")])),
}


@pytest.mark.parametrize("name", sorted(BYTE_LEVEL_VARIANTS) + ["added_flags"] + sorted(SPM_VARIANTS))
def test_variants(name, tmp_path):
    if name in SPM_VARIANTS:
        d = variant("spm", tmp_path, name, SPM_VARIANTS[name])
    elif name == "added_flags":
        d = variant("qwen2", tmp_path, name, add_flagged_tokens)
    else:
        d = variant("qwen2", tmp_path, name, BYTE_LEVEL_VARIANTS[name])
    ref = Tokenizer.from_file(str(d / "tokenizer.json"))
    ctok = CTok(d / "tokenizer.json")
    rng = random.Random(hash(name) & 0xFFFF)
    lines = corpus()
    extra = ["<mask>", " <mask> ", "[SEP]  x", "word", "words", " word ", "_word", "éword", "Été", "E\u0301te\u0301",
             "ﬁne", "fine", " spaced ", "x spaced  y", "<|sp|>", "  <|sp|>  "]
    texts = rng.sample(lines, SOME) + random_strings(rng, lines, special_strings(ref) + extra, max(CASES // 5, SOME // 2))
    check_fast(ref, ctok, texts, rng)
    roundtrip_all(ref, ctok, texts[:500])


def test_subword_affixes(tmp_path):
    """BPE with continuing_subword_prefix and end_of_word_suffix (a WordPiece-like BPE, trained here),
    unk fused, words split on whitespace, no decoder (tokens joined with spaces)."""
    from tokenizers import models, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, continuing_subword_prefix="##", end_of_word_suffix="</w>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\s+"), "removed"),
                                                 pre_tokenizers.Digits(individual_digits=False)])
    lines = corpus()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=1500, special_tokens=["<unk>"], limit_alphabet=120,
                                                       continuing_subword_prefix="##", end_of_word_suffix="</w>",
                                                       show_progress=False))
    d = tmp_path / "affixes"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    ref = Tokenizer.from_file(str(d / "tokenizer.json"))
    rng = random.Random(7)
    texts = rng.sample(lines, 1000) + random_strings(rng, lines, ["<unk>"], 1000)
    check_fast(ref, CTok(d / "tokenizer.json"), texts, rng)


def test_split_special_tokens(tmp_path):
    """tokenizer_config.json's split_special_tokens is tokenizers' encode_special_tokens."""
    d = tmp_path / "split"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((FIX / "qwen2" / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({"split_special_tokens": True}))
    ref = Tokenizer.from_file(str(d / "tokenizer.json"))
    ref.encode_special_tokens = True
    texts = ["<|im_start|>user\nhi<|im_end|>", "a<|endoftext|>b", "<|im_end|>"]
    got = CTok(d).run([{"op": "encode", "text": s, "special": True} for s in texts])
    assert [g["ids"] for g in got] == [ref.encode(s).ids for s in texts]


def test_transformers_tokenizer_config(tmp_path):
    """What transformers 5 makes of tokenizer_config.json: ids with add_special_tokens (its
    add_bos_token / add_eos_token are dropped when tokenizer.json exists: spm_eos asks for eos
    and no bos, and gets the file's template), and decode as transformers does it for BPE."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional reference)")
    d = tmp_path / "spm_eos"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((FIX / "spm" / "tokenizer.json").read_bytes())
    cfg = json.loads((FIX / "spm" / "tokenizer_config.json").read_text())
    cfg.update(add_bos_token=False, add_eos_token=True)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    lines = corpus()[:300] + ["", " ", "<s>x</s>"]
    for path in [FIX / "qwen2", FIX / "llama3", FIX / "spm", FIX / "spm_metaspace", d]:
        hf = transformers.AutoTokenizer.from_pretrained(str(path))
        got = CTok(path).run([{"op": "encode", "text": s, "special": True} for s in lines])
        for s, g in zip(lines, got):
            want = hf(s)["input_ids"]
            assert g["ids"] == want, (path.name, s, g, want)
        dec = CTok(path).run([{"op": "decode", "ids": g["ids"], "skip": sk} for g in got for sk in (False, True)])
        k = 0
        for g in got:
            for sk in (False, True):
                assert dec[k]["text"] == hf.decode(g["ids"], skip_special_tokens=sk), (path.name, g["ids"], sk)
                k += 1
