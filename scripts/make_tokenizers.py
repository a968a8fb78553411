#!/usr/bin/env python3
"""Train the tokenizers rolloutd's tokenizer is tested against, and the default model's tokenizer.

    /opt/torchvenv/bin/python scripts/make_tokenizers.py     (needs only the `tokenizers` package)

Writes, deterministically (fixed seeds; `tokenizers` trains single-threaded here):
  tests/fixtures/tokenizers/corpus.txt   the mixed corpus below: English, code, CJK, Arabic, emoji
                                         and ZWJ sequences, combining marks, digits of every length,
                                         whitespace runs, tabs and newlines, special tokens
  tests/fixtures/tokenizers/qwen2/       byte-level BPE with Qwen2's normalizer (NFC), pre-tokenizer
                                         (its Split regex, then ByteLevel without regex), decoder and
                                         special tokens, as transformers' Qwen2Tokenizer builds it
  tests/fixtures/tokenizers/llama3/      byte-level BPE with Llama 3's pre-tokenizer (\\p{N}{1,3}),
                                         ignore_merges, and its TemplateProcessing that adds
                                         <|begin_of_text|> (transformers' TikTokenConverter layout)
  tests/fixtures/tokenizers/spm/         SentencePiece-style BPE (Llama 2 / Mistral, legacy): byte
                                         fallback tokens <0x00>..<0xFF>, <unk> fused, Prepend + Replace
                                         normalizer, Replace/ByteFallback/Fuse/Strip decoder, <s> added
  tests/fixtures/tokenizers/spm_metaspace/  the same vocabulary with the non-legacy layout: Metaspace
                                         pre-tokenizer (prepend_scheme "first", split false)
  tokenizer/default_tokenizer.json       byte-level BPE, exactly 8192 ids (model/presets.h's default
                                         model): <|pad|> 0, <|begin_of_text|> 1 (bos), <|endoftext|>
                                         2 (eos), <|im_start|> 3, <|im_end|> 4, Qwen2's pipeline; trained
                                         on the corpus plus English-like words made of syllables
Vocabularies are small (a few thousand) so the files stay small. The pipelines are copied from the
configurations those models publish (transformers' tokenization_qwen2.py, convert_slow_tokenizer.py
TikTokenConverter and LlamaConverter).
"""
import json
import os
import pathlib
import random

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "tokenizers"

QWEN2_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

ENGLISH = """The quick brown fox jumps over the lazy dog.
It's a truth universally acknowledged, that a single man in possession of a good fortune must be in want of a wife.
I'm sure they'll say we've done what we'd planned; you're right, it isn't OK.
DON'T SHOUT! She said: "We're LATE," and he replied 'I'VE been waiting since 9:45 a.m.'
Reinforcement learning from human feedback trains a policy against a learned reward model.
The rollout server returns every sampled token with its log-probability, so the trainer can correct the mismatch.
In 1969, Apollo 11 landed on the Moon; 600 million people watched the broadcast.
Prices rose 3.5% in Q3 2024, to $1,234.56 per unit (up from $999.99).
Email me at alice.smith+test@example.com or visit https://example.org/path?q=1&r=two#frag.
Mr. O'Brien's dog isn't as fast as Ms. D'Angelo's cat, but it's friendlier.
Well... that's   interesting — isn't it?  Really?!  Yes!!!
A list: apples, oranges, pears; and (of course) bananas [ripe] {green}.
newline-separated
lines of text
with trailing spaces   
and a blank line above"""

CODE = '''def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
#include <stdio.h>
int main(void) {
\tfor (int i = 0; i < 10; i++) printf("%d\\n", i * i);
\treturn 0;
}
const sum = (xs) => xs.reduce((a, b) => a + b, 0); // arrow function
SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC LIMIT 10;
if (x != nullptr && x->next) { x = x->next; } else { x = NULL; }
fn main() { let v: Vec<u32> = (0..100).filter(|n| n % 3 == 0).collect(); println!("{:?}", v); }
<div class="container"><p id='intro'>Hello&nbsp;world</p></div>
    \t  mixed indentation\t\twith tabs
x = [1, 2, 3]  # comment\r\ny = {"a": 1, "b": [true, false, null]}\r\n
$ ls -la /usr/local/bin | grep -E '^d' && echo "done" >> log.txt'''

CJK = """我们的模型可以在单个GPU上运行，并且支持批量推理。
今天天气很好，我们去公园散步吧！
東京は日本の首都です。ひらがなとカタカナ、そして漢字を使います。
ラーメンを食べに行きましょう。コンピューターサイエンス
한국어도 지원합니다. 안녕하세요, 만나서 반갑습니다!
中文、日本語、한국어が混在する文章：第３章・全角数字１２３と半角123。
《红楼梦》是中国古典小说之一。「引用」と『二重引用』"""

ARABIC = """مرحبا بالعالم! كيف حالك اليوم؟
اللغة العربية تكتب من اليمين إلى اليسار، والأرقام ١٢٣٤٥ أيضاً.
שלום עולם, זה טקסט בעברית.
Привет, мир! Съешь же ещё этих мягких французских булок.
Γειά σου Κόσμε! Ελληνικά γράμματα: αβγδε ΑΒΓΔΕ.
हिन्दी में लिखा गया वाक्य। ภาษาไทยไม่มีช่องว่างระหว่างคำ"""

EMOJI = """I love it 😀😃😄 so much 🎉🎊!
Family: 👨‍👩‍👧‍👦 and couple 👩‍❤️‍👨 and flags 🇺🇸🇯🇵🇫🇷.
Skin tones 👍🏻👍🏼👍🏽👍🏾👍🏿 and keycaps 1️⃣ #️⃣ *️⃣.
Symbols ♥♦♣♠ ★☆ ✓✗ → ← ↑ ↓ ∑∏∫√∞ ≤≥≠ ±×÷ ½¾ ©®™ §¶ €£¥₹
Math 𝔸𝔹ℂ 𝒜ℬ𝒞 and 𝟘𝟙𝟚 and old italic 𐌀𐌁𐌂 and cuneiform 𒀀𒀁.
Zero​width joiner‍and non‌joiner and soft­hyphen and BOM﻿here."""

COMBINING = """Cafe\u0301 vs Café, nai\u0308ve vs naïve, A\u030a vs Å vs \u212b.
Zalgo: Z\u0351\u0308\u0300a\u0307\u0324l\u0352\u0329g\u035bo\u0316\u0359!
Vietnamese: Tiếng Việt có dấu: ắ ằ ẳ ẵ ặ, e\u0302\u0301 vs ế.
Hangul jamo: \u1100\u1161\u11a8 vs 각; ﬁ ligature, ｆｕｌｌｗｉｄｔｈ, ①②③, ㍿.
Decomposed: o\u0308\u0304 u\u0308\u0301 and stacked a\u0301\u0301\u0301\u0301."""

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>",
            "<|start_header_id|>", "<|end_header_id|>", "<s>", "</s>"]


def corpus_lines(rng):
    lines = []
    for block in (ENGLISH, CODE, CJK, ARABIC, EMOJI, COMBINING):
        lines += block.split("\n")
    # digits of every length, alone and in text
    for n in range(1, 41):
        d = "".join(rng.choice("0123456789") for _ in range(n))
        lines.append(d)
        lines.append(f"value {d} units, id={d}x, -{d}.{d[:3]}")
    # whitespace runs, tabs, newlines (as text inside a line)
    for n in range(1, 17):
        lines.append("a" + " " * n + "b" + "\t" * (n % 5) + "c" + "  \n" * (n % 3) + "d")
        lines.append(" " * n + "leading and trailing" + " " * n)
        lines.append("\n" * (n % 4) + "\r\n" * (n % 3) + "x\t\ty" + "\u3000" * (n % 3) + "z\u00a0w")
    # special tokens inside text
    lines += [
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>",
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>",
        "end of doc<|endoftext|>start of next",
        "<s> [INST] Tell me a joke [/INST] Why did the chicken cross the road?</s>",
        "broken <|im_start and <|im_end|>| and <<|endoftext|>> and <s></s><s>",
    ]
    # mixed lines, shuffled from the pieces above
    words = " ".join(lines).split()
    for _ in range(3000):
        k = rng.randint(1, 25)
        sep = rng.choice([" ", " ", " ", "  ", "\t", "\n", ""])
        lines.append(sep.join(rng.choice(words) for _ in range(k)))
    return lines


def write_tokenizer(tok, d, config=None, generation=None):
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"), pretty=False)
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def byte_level_bpe(lines, pattern, vocab, specials, normalizer):
    tok = Tokenizer(models.BPE())
    if normalizer:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def make_qwen2(lines):
    tok = byte_level_bpe(lines, QWEN2_PATTERN, 3000, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], normalizers.NFC())
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    write_tokenizer(tok, FIX / "qwen2",
                    config={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                            "unk_token": None, "clean_up_tokenization_spaces": False, "split_special_tokens": False,
                            "tokenizer_class": "Qwen2Tokenizer"},
                    generation={"bos_token_id": 0, "eos_token_id": [2, 0]})


def make_llama3(lines):
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = byte_level_bpe(lines, LLAMA3_PATTERN, 3000, specials, None)
    bot = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bot)]),
    ])
    data = json.loads(tok.to_str())
    data["model"]["ignore_merges"] = True
    tok = Tokenizer.from_str(json.dumps(data))
    write_tokenizer(tok, FIX / "llama3",
                    config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                            "clean_up_tokenization_spaces": True, "tokenizer_class": "PreTrainedTokenizerFast"},
                    generation={"bos_token_id": bot, "eos_token_id": [tok.token_to_id("<|end_of_text|>"),
                                                                       tok.token_to_id("<|eot_id|>")]})


def make_spm(lines):
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    trainer = trainers.BpeTrainer(vocab_size=2500, special_tokens=["<unk>", "<s>", "</s>"] + byte_tokens,
                                  limit_alphabet=150, show_progress=False)
    tok.train_from_iterator(lines, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    # byte tokens belong to the model's vocabulary, not to the added tokens (as Llama 2 ships them)
    data = json.loads(tok.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in byte_tokens]
    legacy = Tokenizer.from_str(json.dumps(data))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
              "add_eos_token": False, "legacy": True, "clean_up_tokenization_spaces": False,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    write_tokenizer(legacy, FIX / "spm", config=config, generation={"bos_token_id": 1, "eos_token_id": 2})
    data["normalizer"] = None
    data["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    meta = Tokenizer.from_str(json.dumps(data))
    write_tokenizer(meta, FIX / "spm_metaspace", config=dict(config, legacy=False),
                    generation={"bos_token_id": 1, "eos_token_id": 2})


def pseudo_text(rng, n_lines):
    """English-like words from syllables: enough distinct words for 8192 merges."""
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y", "z", "br",
              "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "sl", "sp", "st", "str", "th", "tr", "wh"]
    nuclei = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "ie", "oa", "oo", "ou", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "rt", "st", "ck", "sh", "th", "x"]
    words = sorted({"".join(rng.choice(onsets) + rng.choice(nuclei) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
                    for _ in range(20000)})
    out = []
    for _ in range(n_lines):
        w = [rng.choice(words) for _ in range(rng.randint(3, 14))]
        w[0] = w[0].capitalize()
        out.append(" ".join(w) + rng.choice([".", ",", "!", "?", ":", ";", ""]))
    return out


def make_default(lines):
    specials = ["<|pad|>", "<|begin_of_text|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = byte_level_bpe(lines * 3 + pseudo_text(random.Random(8192), 40000), QWEN2_PATTERN, 8192, specials,
                         normalizers.NFC())
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    n = tok.get_vocab_size()
    if n < 8192:  # a small corpus runs out of merges: reserved ids fill the rest, as Llama 3 ships them
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(8192 - n)])
    assert tok.get_vocab_size() == 8192, tok.get_vocab_size()
    assert [tok.token_to_id(s) for s in specials] == [0, 1, 2, 3, 4]
    tok.save(str(ROOT / "tokenizer" / "default_tokenizer.json"), pretty=False)


def main():
    rng = random.Random(15)
    lines = corpus_lines(rng)
    FIX.mkdir(parents=True, exist_ok=True)
    (FIX / "corpus.txt").write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in lines))
    make_qwen2(lines)
    make_llama3(lines)
    make_spm(lines)
    make_default(lines)
    for d in sorted(p for p in FIX.iterdir() if p.is_dir()):
        t = Tokenizer.from_file(str(d / "tokenizer.json"))
        print(f"{d.relative_to(ROOT)}: vocab {t.get_vocab_size()}")
    print("tokenizer/default_tokenizer.json: vocab",
          Tokenizer.from_file(str(ROOT / "tokenizer" / "default_tokenizer.json")).get_vocab_size())


if __name__ == "__main__":
    main()
