"""A small MLP (256 -> 1024 -> 1024 -> 16): a model whose GPU work per batch is tiny (0.02 ms as a
CUDA graph replay at batch 8 on an H100), so end to end it measures the serving path itself."""
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 16))

    def forward(self, x):
        return self.net(x)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP().eval()
