"""GGUF tokenizer metadata for the fixtures, read from the committed Hugging Face tokenizer.json files.

Plain json parsing: no `tokenizers` package needed, so full-size shapes can be generated on hosts
that only have numpy and gguf. Score rule for the SentencePiece vocabulary: merged pieces in the
file's id order score -0, -1, -2, … (their merge rank), single characters continue below them;
special and byte tokens score 0. llama.cpp's score-driven merge then matches the BPE merges.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf

VOCAB_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "vocab"

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

ZEPHYR_TEMPLATE = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
    "{% endfor %}")


@dataclass
class Vocab:
    model: str                       # tokenizer.ggml.model
    pre: str | None                  # tokenizer.ggml.pre
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    ids: dict[str, int] = field(default_factory=dict)  # bos, eos, unk, pad → id
    add_bos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str = ""

    def padded(self, size: int) -> "Vocab":
        """The vocabulary grown to `size` with unused filler tokens (as converters pad embedding rows)."""
        n = size - len(self.tokens)
        if n < 0:
            raise ValueError(f"vocabulary of {len(self.tokens)} tokens cannot be padded to {size}")
        tokens = self.tokens + [f"[PAD{i}]" for i in range(n)]
        types = self.types + [int(gguf.TokenType.UNUSED)] * n
        scores = None
        if self.scores is not None:
            low = min(self.scores)
            scores = self.scores + [low - 1.0 - i for i in range(n)]
        return Vocab(self.model, self.pre, tokens, types, scores, self.merges, dict(self.ids), self.add_bos,
                     self.add_space_prefix, self.chat_template)

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(self.model)
        if self.pre is not None:
            w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        w.add_token_types(self.types)
        if self.scores is not None:
            w.add_token_scores(self.scores)
        if self.merges is not None:
            w.add_token_merges(self.merges)
        w.add_bos_token_id(self.ids["bos"])
        w.add_eos_token_id(self.ids["eos"])
        if "unk" in self.ids:
            w.add_unk_token_id(self.ids["unk"])
        w.add_pad_token_id(self.ids["pad"])
        w.add_add_bos_token(self.add_bos)
        w.add_add_eos_token(False)
        if self.add_space_prefix is not None:
            w.add_add_space_prefix(self.add_space_prefix)
        w.add_chat_template(self.chat_template)


def _load(name: str) -> tuple[list[str], set[str], list[str]]:
    """(tokens by id, special token strings, merges as 'a b') from fixtures/vocab/<name>.tokenizer.json."""
    data = json.loads((VOCAB_DIR / f"{name}.tokenizer.json").read_text(encoding="utf-8"))
    by_id = {i: t for t, i in data["model"]["vocab"].items()}
    specials = set()
    for added in data["added_tokens"]:
        by_id[added["id"]] = added["content"]
        if added["special"]:
            specials.add(added["content"])
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError(f"{name}: token ids are not contiguous")
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return [by_id[i] for i in range(len(by_id))], specials, merges


def qwen2_bpe() -> Vocab:
    tokens, specials, merges = _load("qwen2_bpe")
    types = [int(gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL) for t in tokens]
    ids = {t: i for i, t in enumerate(tokens)}
    return Vocab("gpt2", "qwen2", tokens, types, merges=merges,
                 ids={"bos": ids["<|endoftext|>"], "eos": ids["<|im_end|>"], "pad": ids["<|endoftext|>"]},
                 add_bos=False, chat_template=CHATML_TEMPLATE)


def llama_spm() -> Vocab:
    tokens, specials, _ = _load("llama_spm")
    types, scores = [], []
    rank = 0
    for t in tokens:
        if t == "<unk>":
            types.append(int(gguf.TokenType.UNKNOWN))
            scores.append(0.0)
        elif t in specials:
            types.append(int(gguf.TokenType.CONTROL))
            scores.append(0.0)
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            types.append(int(gguf.TokenType.BYTE))
            scores.append(0.0)
        else:
            types.append(int(gguf.TokenType.NORMAL))
            scores.append(-float(rank))
            rank += 1
    ids = {t: i for i, t in enumerate(tokens)}
    return Vocab("llama", None, tokens, types, scores=scores,
                 ids={"bos": ids["<s>"], "eos": ids["</s>"], "unk": ids["<unk>"], "pad": ids["</s>"]},
                 add_bos=True, add_space_prefix=True, chat_template=ZEPHYR_TEMPLATE)
