#!/usr/bin/env python3
"""Writes the tokenizer goldens in tests/data/tokenizer/ from Hugging Face tokenizers (the oracle).

    scripts/gen_tokenizer_goldens.py [--smollm2 PATH] [--fixtures DIR]

Oracles, one per vocabulary:
  smollm2  SmolLM2-135M-Instruct's vocabulary and merges read from its GGUF, built with the `tokenizers`
           library exactly as SmolLM2's tokenizer.json declares it: BPE (no unk token); pre-tokenizer
           Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)];
           ByteLevel decoder; the 17 control tokens added as special tokens.
  qwen2    fixtures/vocab/qwen2_bpe.tokenizer.json (the qwen2-pre fixture vocabulary), loaded as is.
  spm      fixtures/vocab/llama_spm.tokenizer.json (the SentencePiece fixture vocabulary), loaded as is.
Cross-check (printed, and recorded in each file): transformers' own GGUF -> tokenizer converter (what
AutoTokenizer.from_pretrained(dir, gguf_file=name) runs) on the same GGUF; the strings where it differs
from the oracle are listed, since the converter knows neither SmolLM2's digit split nor a per-segment
SentencePiece prefix.
With --fixtures, the fixture GGUFs tiny-qwen2-f32.gguf and tiny-llama-f32.gguf are cross-checked too.

Also writes pretokenize.json: the pieces each pre-tokenizer (gpt2, llama3, qwen2, smollm) splits every
string into, from the same library's pre-tokenizers.

parse_special = false is Hugging Face's encode_special_tokens = True (special tokens read as text).
Qwen2's tokenizer.json normalizes to NFC, which diffrun (like llama.cpp) does not: the qwen2 strings are
checked to be NFC already, and decomposed text is tested on the other vocabularies only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import unicodedata
from pathlib import Path

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "tokenizer"
VOCAB_DIR = ROOT / "fixtures" / "vocab"

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")

# Shared strings: prose, numbers, contractions, whitespace, code, accents, CJK, emoji, byte splits.
COMMON = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today?",
    "7", "42", "123", "2024", "12345",
    "1 12 123 1234 12345 123456",
    "Pi is 3.14159 and e is 2.71828",
    "Call 555-0199 or +1 (800) 123-4567",
    "I'm sure you're right, it's what we've said and they'll do, I'd think.",
    "I'M SURE YOU'RE RIGHT, IT'S WHAT WE'VE SAID AND THEY'LL DO, I'D THINK.",
    "Don't won't can't shouldn't y'all",
    "rock 'n' roll 's 'S 'Ll 'lL 'Re 'VE 'D 'M 'T",
    "  two leading spaces",
    "trailing spaces   ",
    " ",
    "   ",
    "a  b   c    d",
    "tab\tseparated\t\tvalues",
    "line one\nline two\n\nline four\r\nwindows",
    "\n\n\n",
    "\t \n \t",
    "mixed \n\t  \n  end",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    "if x == 1:\n\tprint(\"yes\")  # comment",
    "<div class=\"main\">&nbsp;</div>",
    "SELECT * FROM users WHERE id = 42;",
    "café naïve résumé façade",
    "Ünïcödé ÀÉÎÕÜ Größe straße",
    "Ελληνικά και русский текст",
    "你好，世界！",
    "日本語のテキストです。",
    "한국어 텍스트",
    "中文123混合English",
    "I ❤️ emoji 😀🎉",
    "family: 👨‍👩‍👧‍👦 and 🏳️‍🌈",
    "👍🏽 thumbs up",
    "a😀b x\u00e9y z\u4e2dw",
    "Rare: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ ᚠᛇᚻ",
    "\u00a0nbsp\u2009thin\u3000ideographic\u2028sep",
    "zero\u200bwidth\u200djoiner",
    "Email: test@example.com, URL: https://example.com/path?q=1&r=2",
    "Price: $1,234.56 (€1.234,56)",
    "snake_case_name camelCaseName",
    "...!!!??? --- ***",
    "'quoted' \"double\" `back`",
    "Math: ∑ x² ≤ ∞ ± √2, ½ ٣٤ Ⅻ",
    "repeated aaaaaaaaaaaaaaaaaaaa",
    "ſ'ſ 'ſt 'ſx",
    "Ω K Å",
]
NOT_NFC = ["combining e\u0301 and a\u0308 (decomposed)"]

SPECIAL = {
    "smollm2": [
        ("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", True),
        ("<|endoftext|>x<repo_name>y<|im_end|>", True),
        ("<|im_start|>user\nHi there<|im_end|>", False),
        ("a<|im_start|b <|im_end|>", True),
    ],
    "qwen2": [
        ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n", True),
        ("<|endoftext|><|im_start|>", True),
        ("<|im_start|>user\nHi<|im_end|>", False),
    ],
    "spm": [
        ("<s>Hello</s> world", True),
        ("Hi<unk>there <s>", True),
        ("<|user|>\nHello</s>\n<|assistant|>\n", True),
        ("<s>Hello</s> world", False),
    ],
}


def byte_decoder() -> dict[str, int]:
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def gguf_vocab(path: Path) -> tuple[list[str], list[int], list[str]]:
    r = gguf.GGUFReader(str(path))

    def strings(key: str) -> list[str]:
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    t = r.fields["tokenizer.ggml.token_type"]
    return strings("tokenizer.ggml.tokens"), [int(t.parts[i][0]) for i in t.data], strings("tokenizer.ggml.merges")


def smollm2_oracle(path: Path) -> Tokenizer:
    tokens, types, merges = gguf_vocab(path)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == int(gguf.TokenType.CONTROL)])
    return tok


def encode(tok: Tokenizer, text: str, parse_special: bool, add_bos: bool) -> list[int]:
    tok.encode_special_tokens = not parse_special
    try:
        return tok.encode(text, add_special_tokens=add_bos).ids
    finally:
        tok.encode_special_tokens = False


def transformers_ids(gguf_path: Path, texts: list[tuple[str, bool]]) -> list[list[int]] | None:
    """Ids from transformers' GGUF -> tokenizer converter, or None when transformers is not installed.

    AutoTokenizer.from_pretrained(dir, gguf_file=name) reads the metadata with a reader that needs torch;
    this does what it does after that (get_gguf_tokenizer, convert_gguf_tokenizer) on the metadata read
    by the gguf package instead, so the converter itself is what is checked.
    """
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                           convert_gguf_tokenizer)
    except ImportError:
        return None
    r = gguf.GGUFReader(str(gguf_path))
    md = {k: f.contents() for k, f in r.fields.items() if k.startswith(("tokenizer.", "general.architecture"))}
    tokenizer_dict = {name: md[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
                      if f"tokenizer.{key}" in md}
    tok, _ = convert_gguf_tokenizer(md["general.architecture"], tokenizer_dict)
    return [encode(tok, text, parse_special, False) for text, parse_special in texts]


def cases_for(name: str) -> list[tuple[str, bool]]:
    texts = COMMON + (NOT_NFC if name != "qwen2" else [])
    if name == "qwen2":
        for t in texts:
            assert unicodedata.normalize("NFC", t) == t, f"qwen2 golden string is not NFC: {t!r}"
    cases = [(t, True) for t in texts] + [(t, False) for t in texts[:5]]
    return cases + SPECIAL[name]


def write_goldens(name: str, tok: Tokenizer, gguf_path: Path | None, model: str, oracle: str,
                  add_bos: bool) -> None:
    cases = cases_for(name)
    out = []
    for text, parse_special in cases:
        ids = encode(tok, text, parse_special, False)
        out.append({"text": text, "parse_special": parse_special, "add_bos": False, "ids": ids,
                    "decoded": tok.decode(ids, skip_special_tokens=False)})
    if add_bos:  # a fresh sequence: the post-processor adds BOS
        for text in ["Hello world", " leading space"]:
            ids = encode(tok, text, True, True)
            out.append({"text": text, "parse_special": True, "add_bos": True, "ids": ids,
                        "decoded": tok.decode(ids, skip_special_tokens=False)})
    cross = "not run (no GGUF given)"
    if gguf_path is not None and gguf_path.exists():
        got = transformers_ids(gguf_path, [(c["text"], c["parse_special"]) for c in out if not c["add_bos"]])
        if got is None:
            cross = "not run (transformers not installed)"
        else:
            want = [c["ids"] for c in out if not c["add_bos"]]
            bad = [c["text"] for c, g, w in zip(out, got, want) if g != w]
            cross = (f"transformers GGUF converter on {gguf_path.name}: "
                     f"{len(want) - len(bad)}/{len(want)} strings agree")
            print(f"{name}: {cross}", file=sys.stderr)
            for t in bad:
                print(f"  differs: {t!r}", file=sys.stderr)
    doc = {"tokenizer": name, "model": model, "oracle": oracle, "cross_check": cross,
           "regenerate": "scripts/gen_tokenizer_goldens.py", "cases": out}
    (OUT / f"{name}.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"{name}: {len(out)} cases", file=sys.stderr)


def write_pretokenize() -> None:
    bd = byte_decoder()

    def byte_level(pt: pre_tokenizers.PreTokenizer):
        def split(text: str) -> list[str]:
            return [bytes(bd[c] for c in p).decode("utf-8") for p, _ in pt.pre_tokenize_str(text)]
        return split

    def regex(pattern: str):
        pt = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        return lambda text: [p for p, _ in pt.pre_tokenize_str(text)]

    splitters = {
        "gpt2": byte_level(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)),
        "smollm": byte_level(pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                      pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                               use_regex=True)])),
        "llama3": regex(LLAMA3_PATTERN),
        "qwen2": regex(QWEN2_PATTERN),
    }
    texts = COMMON + NOT_NFC + [t for cases in SPECIAL.values() for t, _ in cases] + [
        "x\r\n\r\n  y", "a \n b", "  \n\n  c", "\u3000\u3000x", "(hello) [world]", "\"'quote'\"", "99 bottles",
        "'''s", "1,000,000", "x  ", "A\u0301B"]
    doc = {"oracle": "Hugging Face tokenizers pre-tokenizers: ByteLevel(use_regex) for gpt2, "
                     "Digits(individual_digits) + ByteLevel for smollm, Split(Isolated) with the tokenizer.json "
                     "regex for llama3 and qwen2",
           "regenerate": "scripts/gen_tokenizer_goldens.py",
           "cases": [{"text": t, "pieces": {k: f(t) for k, f in splitters.items()}} for t in texts]}
    (OUT / "pretokenize.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"pretokenize: {len(texts)} strings x {len(splitters)} pre-tokenizers", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_models = Path(os.environ.get("DIFFRUN_MODELS") or
                          Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "diffrun" / "models")
    ap.add_argument("--smollm2", type=Path, default=default_models / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--fixtures", type=Path, help="folder of generated fixtures, for the transformers cross-check")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    fixture = (lambda n: args.fixtures / n) if args.fixtures else (lambda n: None)

    write_goldens("smollm2", smollm2_oracle(args.smollm2), args.smollm2, args.smollm2.name,
                  "tokenizers: BPE + Sequence[Digits(individual_digits), ByteLevel] built from the GGUF's "
                  "vocabulary and merges as SmolLM2's tokenizer.json declares", add_bos=False)
    write_goldens("qwen2", Tokenizer.from_file(str(VOCAB_DIR / "qwen2_bpe.tokenizer.json")),
                  fixture("tiny-qwen2-f32.gguf"), "tiny-qwen2-f32.gguf",
                  "tokenizers: fixtures/vocab/qwen2_bpe.tokenizer.json", add_bos=False)
    write_goldens("spm", Tokenizer.from_file(str(VOCAB_DIR / "llama_spm.tokenizer.json")),
                  fixture("tiny-llama-f32.gguf"), "tiny-llama-f32.gguf",
                  "tokenizers: fixtures/vocab/llama_spm.tokenizer.json", add_bos=True)
    write_pretokenize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
