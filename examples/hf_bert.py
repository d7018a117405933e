"""A Hugging Face `transformers` BERT classifier as a user has one, handed over the way the README's
"Serve your own model" says: exported with torch.export (batch and length dynamic), the program
saved, and compiled with AOTInductor. Random weights from a config (seeded; nothing is
downloaded). Plain torch and transformers only: bench/bench_e2e.py copies this file into its
stock handlers' archives as their model factory.

inputs:  input_ids      int64 [B, S]  token ids, 0..vocab-1 (BERT's padding id is 0)
         attention_mask int64 [B, S]  1 for a real token, 0 for padding
outputs: logits         [B, labels]
         last_hidden_state [B, S, hidden]  (bert_tiny only: a per-token output)

bert_tiny():  2 layers, hidden 32, 2 heads, vocabulary 1000, lengths 4..64, batch 1..16 (CPU tests)
bert_bench(): 6 layers, hidden 768, 12 heads, vocabulary 30522, lengths 8..256, batch 1..64 (the
              end-to-end benchmark's model, fp16 on the GPU)

    python -m examples.hf_bert --size bench --device cuda --dtype float16 --out DIR
writes DIR/program.pt2 (torch.export.save) and DIR/package.pt2 (aoti_compile_and_package).
"""
import argparse
import os

import torch
from torch import nn

SIZES = {  # config, (batch min, max), (length min, max), per-token output
    "tiny": (dict(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64, max_position_embeddings=128, num_labels=3), (1, 16), (4, 64), True),
    "bench": (dict(vocab_size=30522, hidden_size=768, num_hidden_layers=6, num_attention_heads=12,
                   intermediate_size=3072, max_position_embeddings=512, num_labels=2), (1, 64), (8, 256), False),
}


class PlainOutputs(nn.Module):
    """The model with plain tensors out (a dict), as the handler serves them: a transformers
    ModelOutput is not a tensor, a tuple or a dict of tensors."""

    def __init__(self, model, per_token: bool):
        super().__init__()
        self.model, self.per_token = model, per_token

    def forward(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=self.per_token)
        if self.per_token:
            return {"logits": out.logits, "last_hidden_state": out.hidden_states[-1]}
        return {"logits": out.logits}


def build(size: str) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config, _, _, per_token = SIZES[size]
    # "sdpa": torch's scaled_dot_product_attention, which torch.export traces with the mask as
    # an input; the weights are the config's initialisation from torch's seeded generator
    cfg = BertConfig(**config, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):  # the same weights every time; the caller's generator untouched
        torch.manual_seed(0)
        return PlainOutputs(BertForSequenceClassification(cfg), per_token).eval()


def bert_tiny() -> nn.Module:
    return build("tiny")


def bert_bench() -> nn.Module:
    return build("bench")


def export(size: str, device: str = "cpu", dtype: str = "float32"):
    """(eager model, torch.export program) with the batch and the length dynamic."""
    from torch.export import Dim

    _, (bmin, bmax), (smin, smax), _ = SIZES[size]
    model = build(size).to(device=device, dtype=getattr(torch, dtype))
    vocab = SIZES[size][0]["vocab_size"]
    ids = torch.randint(0, vocab, (2, 16), device=device)
    mask = torch.ones(2, 16, dtype=torch.int64, device=device)
    batch, length = Dim("batch", min=bmin, max=bmax), Dim("length", min=smin, max=smax)
    with torch.no_grad():
        ep = torch.export.export(model, (ids, mask), dynamic_shapes={
            "input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}})
    return model, ep


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="bench")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    _, ep = export(args.size, args.device, args.dtype)
    torch.export.save(ep, os.path.join(args.out, "program.pt2"))
    torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(args.out, "package.pt2"))
    print(f"wrote {args.out}/program.pt2 and {args.out}/package.pt2")


if __name__ == "__main__":
    main()
