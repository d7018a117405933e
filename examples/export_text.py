"""What a user's own pipeline does to hand a model over: export it with torch.export, the
sequence length dynamic, and save the program. Plain torch only; the serving side reads
everything it needs (names, dtypes, the length range, valid token ids) from the saved file.

    python -m examples.export_text artifacts/mine.pt2
"""
import os
import sys

import torch
from torch.export import Dim

from examples.text_encoder import text_encoder_tiny


def main(path: str) -> None:
    model = text_encoder_tiny()
    ids = torch.randint(0, 1000, (4, 16))
    mask = torch.ones(4, 16, dtype=torch.int64)
    batch, length = Dim("batch", min=1, max=16), Dim("length", min=4, max=64)
    ep = torch.export.export(model, (ids, mask), dynamic_shapes={
        "input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}})
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.export.save(ep, path)
    print(f"saved {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mine.pt2")
