"""Trains the two small fixture vocabularies from fixtures/vocab/corpus.txt with Hugging Face tokenizers.

Writes qwen2_bpe.tokenizer.json (byte-level BPE, Qwen2 pre-tokenizer) and llama_spm.tokenizer.json
(Llama-style BPE with byte fallback whose merges are derived from the vocabulary order, so that
llama.cpp's score-driven SentencePiece merging with score = -rank gives the same tokens).
Training is deterministic: the committed files are what this script writes.

    python3 scripts/fixturegen/train_vocab.py [--out fixtures/vocab]
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_VOCAB_SIZE = 1500   # byte alphabet + merges, before the special tokens
LLAMA_SPECIALS = ["<unk>", "<s>", "</s>"]
LLAMA_TRAIN_SIZE = 1200   # characters + merged pieces, before specials and the 256 byte tokens
SPIECE = "\u2581"


def corpus_lines(corpus: Path) -> list[str]:
    return corpus.read_text(encoding="utf-8").splitlines(keepends=True)


def train_qwen2_bpe(lines: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=QWEN2_VOCAB_SIZE, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer=trainer)
    tok.add_special_tokens(QWEN2_SPECIALS)
    return tok


def spm_merges(vocab: dict[str, int], scored: list[str]) -> list[tuple[str, str]]:
    """Every split of a scored piece into two vocabulary pieces, ranked by the piece's score (its order
    in `scored`, best first), then by the ids of the two halves: transformers' SentencePieceExtractor."""
    merges = []
    for piece in scored:
        local = [(piece[:i], piece[i:]) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    return merges


def train_llama_spm(lines: list[str]) -> Tokenizer:
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE, prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=LLAMA_TRAIN_SIZE, min_frequency=1, show_progress=False)
    trainer_tok.train_from_iterator([line.rstrip("\n") for line in lines], trainer=trainer)
    trained = sorted(trainer_tok.get_vocab().items(), key=lambda kv: kv[1])
    chars = [t for t, _ in trained if len(t) == 1]
    pieces = [t for t, _ in trained if len(t) > 1]   # in merge order: the best-scored first
    # Llama's layout: <unk> <s> </s>, <0x00>..<0xFF>, merged pieces by score, single characters last.
    ordered = LLAMA_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + pieces + chars
    vocab = {t: i for i, t in enumerate(ordered)}
    merges = spm_merges(vocab, pieces)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE), normalizers.Replace(" ", SPIECE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPIECE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens(LLAMA_SPECIALS)
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=REPO / "fixtures/vocab/corpus.txt")
    ap.add_argument("--out", type=Path, default=REPO / "fixtures/vocab")
    args = ap.parse_args()
    lines = corpus_lines(args.corpus)
    args.out.mkdir(parents=True, exist_ok=True)
    train_qwen2_bpe(lines).save(str(args.out / "qwen2_bpe.tokenizer.json"))
    train_llama_spm(lines).save(str(args.out / "llama_spm.tokenizer.json"))


if __name__ == "__main__":
    main()
