"""Text in and out of a decoder through the archive's tokenizer (`tokenizer.json`, read with the
`tokenizers` library, as transformers' fast tokenizers are): the prompt's ids, the streamed text
of each new token, and stop sequences.

Streaming text token by token: a token may end inside a character (byte-level BPE splits UTF-8
sequences) or change how the text before it reads, so each new piece is the decode of a short
window of recent ids minus the decode of the same window without the new ones, held back while
it ends in U+FFFD (an unfinished character), as Text Generation Inference and vLLM do.
"""
from __future__ import annotations

import os
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
