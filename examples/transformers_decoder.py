"""A `transformers` causal language model exported the way transformers exports one for
on-device runtimes (`transformers.integrations.executorch.TorchExportableModuleForDecoderOnlyLM`:
a static KV cache, `input_ids` [1, S] and `cache_position` [S] in, logits [1, S, vocab] out), with
a dynamic S so the handler fills the cache with a whole prompt in one call.

  python -m examples.transformers_decoder --out lm.pt2 --tokenizer-out tokenizer.json
  python -m examples.transformers_decoder --model PATH_OR_HUB_ID --out lm.pt2 --max-cache 2048

Without --model: a small Llama with seeded random weights and a byte-level BPE tokenizer trained
on a few sentences (no download), for tests and the quickstart.
"""
from __future__ import annotations

import argparse

import torch

SENTENCES = ["the quick brown fox jumps over the lazy dog", "serving compiled models on a GPU fleet",
             "a language model answers one token at a time", "naïve café déjà vu — ünïcödé 文字"]


def tiny_tokenizer(vocab_size: int = 300, special_tokens=("</s>",)):
    """A byte-level BPE (as GPT-2's and Llama 3's) with </s> as its end-of-sequence token (and any
    other special tokens named: ChatML's <|im_start|> and <|im_end|> for a chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 4, trainer)
    return tok


def tiny_llama(vocab_size: int = 300, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def export(model, max_cache: int = 64):
    """The model's static-cache export with a dynamic sequence length (1..max_cache - 1)."""
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static", max_length=max_cache,
                                               cache_config={"batch_size": 1, "max_cache_len": max_cache})
    seq = torch.export.Dim("seq", min=1, max=max_cache - 1)
    with torch.no_grad():
        return TorchExportableModuleForDecoderOnlyLM(model).export(
            input_ids=torch.zeros(1, 4, dtype=torch.long), cache_position=torch.arange(4),
            dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}}, strict=False)


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load(path: str, dtype: str):
    """(model, its tokenizers.Tokenizer) from a transformers checkpoint directory (or hub id), in
    the checkpoint's dtype (`auto`) or the one named. Refuses a checkpoint whose tokenizer files are
    missing or do not cover the model (transformers then gives a tokenizer of one or a few tokens,
    which would turn every text into unknown ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto" if dtype == "auto" else DTYPES[dtype]).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path).backend_tokenizer
    except (OSError, ValueError, AttributeError) as e:
        raise SystemExit(f"transformers_decoder: {path} has no usable tokenizer ({type(e).__name__}: {e}); "
                         "save it beside the model: AutoTokenizer.from_pretrained(SOURCE).save_pretrained(DIR)")
    have, want = tokenizer.get_vocab_size(), model.config.vocab_size
    if have < 2 or have > want:
        raise SystemExit(f"transformers_decoder: {path}'s tokenizer holds {have} token(s), the model's vocabulary "
                         f"{want}: the tokenizer files are missing or belong to another model; save the model's "
                         "own tokenizer beside it (AutoTokenizer.from_pretrained(SOURCE).save_pretrained(DIR))")
    return model, tokenizer


def check_cache(model, max_cache: int) -> None:
    """--max-cache within the positions the model was trained for (GPT-2 has 1024, its position
    table has no row past it: the export ran, then the archive failed with 'index out of range')."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions and max_cache > positions:
        raise SystemExit(f"transformers_decoder: --max-cache {max_cache} is more than the {positions} positions "
                         f"this model has (config.max_position_embeddings): use --max-cache {positions} or less")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a transformers causal LM (path or hub id); default: a tiny random Llama")
    p.add_argument("--out", required=True, help="where to torch.export.save the program")
    p.add_argument("--tokenizer-out", help="where to write its tokenizer.json")
    p.add_argument("--max-cache", type=int, default=64, help="KV cache positions (prompt and generated tokens)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="the weights' dtype in the export (auto: the checkpoint's own)")
    args = p.parse_args(argv)
    if args.model:
        model, tokenizer = load(args.model, args.dtype)
    else:
        model, tokenizer = tiny_llama(), tiny_tokenizer()
        model = model.to(DTYPES[args.dtype]) if args.dtype != "auto" else model
    check_cache(model, args.max_cache)
    torch.export.save(export(model, args.max_cache), args.out)
    print(f"wrote {args.out} ({next(model.parameters()).dtype}, cache of {args.max_cache} positions)")
    if args.tokenizer_out:
        tokenizer.save(args.tokenizer_out)
        print(f"wrote {args.tokenizer_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
