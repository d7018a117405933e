"""Text in and out of a decoder through the archive's tokenizer (`tokenizer.json`, read with the
`tokenizers` library, as transformers' fast tokenizers are): the prompt's ids, the streamed text
of each new token, and stop sequences.

Streaming text token by token: a token may end inside a character (byte-level BPE splits UTF-8
sequences) or change how the text before it reads, so each new piece is the decode of a short
window of recent ids minus the decode of the same window without the new ones, held back while
it ends in U+FFFD (an unfinished character), as Text Generation Inference and vLLM do.
"""
from __future__ import annotations

import json
import os
import re
from typing import Optional

TOKENIZER_FILE = "tokenizer.json"
# Names tokenizers give their end-of-sequence tokens (Llama 2, Llama 3 base and chat, GPT-2,
# Qwen/ChatML, Gemma, Mistral): the ids the generation stops at when the archive names none.
EOS_NAMES = ("</s>", "<|end_of_text|>", "<|eot_id|>", "<|endoftext|>", "<|im_end|>", "<eos>", "<|end|>")


class Text:
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(path)
        self.eos_ids = tuple(i for i in (self.tokenizer.token_to_id(n) for n in EOS_NAMES) if i is not None)
        self.max_token_bytes = max_token_bytes(self.tokenizer)
        self.chat = None  # the archive's ChatTemplate (handlers/generation/chat.py), set by in_dir
        self._raw = None  # id -> the token's own bytes (token_texts), made at its first use

    @classmethod
    def in_dir(cls, model_dir: str) -> Optional["Text"]:
        from handlers.generation.chat import ChatTemplate

        path = os.path.join(model_dir, TOKENIZER_FILE)
        if not os.path.isfile(path):
            return None
        text = cls(path)
        text.chat = ChatTemplate.in_dir(model_dir)  # tokenizer_config.json's chat_template, or None
        return text

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_texts(self, ids: list, prev: Optional[int]) -> list:
        """[(text, UTF-8 bytes or None)] of each of `ids` as the token after `prev` (OpenAI's log
        probabilities name tokens so): a token's own bytes where the vocabulary holds them (a
        byte-level BPE's, a byte-fallback `<0xNN>`, a special token's content), its text their
        UTF-8 with a part of a character written as \\xNN; else the text it adds after `prev`
        (a SentencePiece word's leading space), bytes None where that is no whole character."""
        if self._raw is None:
            self._raw = _raw_bytes(self.tokenizer)
        raw = [self._raw(t) for t in ids]
        out = [None if b is None else (b.decode("utf-8", "backslashreplace"), b) for b in raw]
        rest = [i for i, o in enumerate(out) if o is None]
        if rest:
            ctx = [prev] if prev is not None else []
            before = self.tokenizer.decode(ctx, skip_special_tokens=False)
            after = self.tokenizer.decode_batch([ctx + [ids[i]] for i in rest], skip_special_tokens=False)
            for i, a in zip(rest, after):
                s = a[len(before):] if a.startswith(before) else \
                    self.tokenizer.decode([ids[i]], skip_special_tokens=False)
                out[i] = (s, None if "\ufffd" in s else s.encode("utf-8"))
        return out


def _raw_bytes(tokenizer):
    """id -> the token's own bytes, or None where the vocabulary's string is no byte sequence
    (a SentencePiece word piece: its text is its decode in context); cached per id."""
    # the decoder's own JSON (its pickled state), not the whole tokenizer's: Tokenizer.to_str of a
    # 151,936-token vocabulary took 109 ms on the CI CPU, on the thread that delivers every
    # stream's tokens, at the first request asking for log probabilities; this 0.03 ms
    decoder = json.loads(tokenizer.decoder.__getstate__()) if tokenizer.decoder is not None else {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
    table = _byte_level_table() if "ByteLevel" in kinds else None
    added = {i: t.content.encode("utf-8") for i, t in tokenizer.get_added_tokens_decoder().items()}
    cache: dict = {}

    def raw(tid: int) -> Optional[bytes]:
        if tid in cache:
            return cache[tid]
        piece, out = tokenizer.id_to_token(tid), added.get(tid)
        if out is None and piece is not None:
            byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
            if byte:
                out = bytes([int(byte.group(1), 16)])
            elif table is not None and all(c in table for c in piece):
                out = bytes(table[c] for c in piece)
        cache[tid] = out
        return out
    return raw


def _byte_level_table() -> dict:
    """A byte-level BPE's character -> byte (GPT-2's bytes_to_unicode, inverted)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes of text one token can stand for, read from the vocabulary once: the
    longest token string. A token string is never shorter than the text it covers in byte-level
    BPE (each byte is one character of at most two bytes), SentencePiece (a space becomes the
    three-byte U+2581, a byte-fallback token <0xNN> is six) and WordPiece ("##" marks); so a text
    of more than cache_length times this many bytes cannot fit in the cache (a normalizer that
    deletes characters, or an unknown-word token, is the exception: such a text is refused too)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1) or 1


class Detokenizer:
    """The text of a growing list of token ids, piece by piece (module docstring)."""

    def __init__(self, text: Text, prompt_ids: list):
        self.text = text
        self.ids = list(prompt_ids[-4:])  # a few ids of context: a word's leading space decodes right
        self.prefix = 0
        self.read = len(self.ids)

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.text.decode(self.ids[self.prefix:self.read])
        after = self.text.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""


class StopText:
    """Text released as it arrives, except what could be the start of a stop sequence; `add`
    returns (the text safe to send, whether a stop sequence ended it)."""

    def __init__(self, stops: tuple):
        self.stops = stops
        self.held = ""

    def add(self, piece: str) -> tuple:
        held = self.held + piece
        for s in self.stops:
            at = held.find(s)
            if at >= 0:
                self.held = ""
                return held[:at], True
        keep = max((k for s in self.stops for k in range(1, len(s)) if held.endswith(s[:k])), default=0)
        self.held = held[len(held) - keep:] if keep else ""
        return held[:len(held) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
