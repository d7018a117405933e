"""Example models shipped with the repository (no downloads): seeded random weights.

classifier: a small image classifier with BatchNorm buffers and a dynamic batch dimension.
two_input:  two named inputs (float features, bool mask) and a dict of outputs; its forward
            creates tensors with `device=` arguments and holds a buffer and a tensor constant,
            the things that stay on the old device when a program moves to another GPU.
big_mlp:    16 Linear(8192, 8192) layers, 2 GiB of fp16 weights (the shared-weights figures).
text:       token ids and an attention mask of any length up to 128 (int64, [B, S]): a small text
            model whose embedding tables make ids past 999 invalid, and whose answer for a text
            does not depend on padding (the mask excludes padded positions).
"""
import torch
from torch import nn


class SmallClassifier(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, num_classes)

    def forward(self, image):
        return self.head(torch.flatten(self.features(image), 1))


class TwoInput(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.proj = nn.Linear(width, 32)
        self.score = nn.Linear(32, 1)
        self.cls = nn.Linear(32, 4)
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, width))
        self.scale = torch.tensor(0.5)  # a plain tensor attribute: export lifts it as a constant
        self.width = width

    def forward(self, features, mask):
        pos = torch.arange(self.width, device=features.device, dtype=features.dtype) / self.width
        x = torch.where(mask, features + self.offset + pos, torch.zeros_like(features))
        h = torch.relu(self.proj(x)) * self.scale + torch.ones(1, device=features.device)
        return {"score": torch.sigmoid(self.score(h)), "probs": torch.softmax(self.cls(h), dim=-1)}


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return module.eval()


def classifier() -> nn.Module:
    return _seeded(SmallClassifier(), 0)


def two_input() -> nn.Module:
    return _seeded(TwoInput(), 1)


class BigConv(nn.Module):
    """Full-resolution conv stack with a same-size output: at 1x3x2160x3840 its compute takes
    longer than its transfers, so a missing stream synchronization shows as wrong outputs."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(16, 3, 3, padding=1))

    def forward(self, image):
        return self.body(image) + image


def big_conv() -> nn.Module:
    return _seeded(BigConv(), 2)


def resnet50() -> nn.Module:
    """torchvision's ResNet-50 with seeded random weights (torchvision is on the GPU machine)."""
    import torchvision

    class ResNet50(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.net = torchvision.models.resnet50(weights=None)

        def forward(self, image):  # the input name requests use
            return self.net(image)

    return ResNet50().eval()


class Lookup(nn.Module):
    """ids (int64, [B, 3]) -> the mean of their rows in an 8-row table, through a linear head.
    An id outside 0..7 is a valid request by the input contract (int64, right shape) that the
    model itself cannot run: the embedding raises at run time, in eager and in the exported
    program. Used to test that only the failing request of a batch fails."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids):
        return self.head(self.table(ids).mean(dim=1))


def lookup() -> nn.Module:
    return _seeded(Lookup(), 4)


class Outer(nn.Module):
    """x (float32, [B, 8192]) -> [B, 1] through a B x 8192 x 8192 intermediate (256 MiB per row in
    fp32, materialized by the exported program's eager ops): device memory grows with the rows of
    a call, so one large request runs out of CUDA memory while small ones fit
    (tests/test_faults_gpu.py)."""

    def forward(self, x):
        return (x.unsqueeze(2) * x.unsqueeze(1)).mean(dim=(1, 2)).unsqueeze(1)


def outer() -> nn.Module:
    return Outer().eval()


class TextClassifier(nn.Module):
    """input_ids, attention_mask (int64, [B, S], S <= 128) -> logits [B, 4] and per-token
    features [B, S, 32]: token + position embeddings, one self-attention layer that ignores
    masked positions, mean-pooled over the unmasked ones."""

    def __init__(self, vocab: int = 1000, width: int = 32, max_len: int = 128):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(max_len, width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.head = nn.Linear(width, 4)

    def forward(self, input_ids, attention_mask):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        h = self.tokens(input_ids) + self.positions(pos)
        keep = attention_mask.to(h.dtype).unsqueeze(-1)
        bias = (1.0 - attention_mask.to(h.dtype)).unsqueeze(1) * -1e4  # [B, 1, S] over keys
        a, _ = self.attn(h, h, h, attn_mask=bias.repeat_interleave(4, dim=0).expand(-1, h.shape[1], -1),
                         need_weights=False)
        h = (h + a) * keep
        pooled = h.sum(1) / keep.sum(1).clamp(min=1.0)
        return {"logits": self.head(pooled), "features": h}


def text() -> nn.Module:
    return _seeded(TextClassifier(), 5)


class Wide(nn.Module):
    """x (float32, [B, 16 Mi]) -> [B, 16]: 64 MiB per row, so one request is the largest body the
    KServe pod is measured with (bench/bench_pod.py's largest batch; the pod's limit is
    max_request_size in kserve/config.properties, 128 MiB). Block means through a linear head."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4096, 16)

    def forward(self, x):
        return self.head(x.reshape(-1, 4096, 4096).mean(-1))


def wide() -> nn.Module:
    return _seeded(Wide(), 6)


class BigMLP(nn.Module):
    """x (float32, [B, 8192]) -> [B, 8192]: 16 Linear(8192, 8192) layers with ReLU between, 2 GiB of
    weights in fp16 (4 GiB in fp32): the model the engine's memory and restart figures are measured
    on (bench/bench_shared.py; before it, the retired weights holder's: docs/shared-weights.md; issue 49
    asks for a model of at least 2 GB). Weights scaled by sqrt(6)
    so activations keep a variance near 1 through the stack (uniform init has variance
    1/(3 fan_in); ReLU halves it) and fp16 answers are not all zeros."""

    def __init__(self, layers: int = 16, width: int = 8192):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.mul_(6 ** 0.5)

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x)


def big_mlp() -> nn.Module:
    with torch.random.fork_rng():  # torch's own init, seeded (_seeded's N(0, 0.2) would overflow fp16 here)
        torch.manual_seed(7)
        return BigMLP().eval()


class DevicesNamed(nn.Module):
    """Every kind of state an export lifts and devices named in forward (issue 62): a conv and a
    BatchNorm (parameters, running statistics), a registered buffer, a plain tensor attribute
    (a lifted constant), a tensor made on the input's device and one made on a device named by
    string (`named`, moved to the input's: a graph node with device=`named`)."""

    def __init__(self, named: str = "cpu"):
        super().__init__()
        self.named = named
        self.conv = nn.Conv1d(2, 3, 1)
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("shift", torch.linspace(0, 1, 3))
        self.scale = torch.tensor([2.0, 3.0, 4.0])

    def _apply(self, fn, recurse=True):  # .to(device) moves the plain attribute too, as users write it
        self.scale = fn(self.scale)
        return super()._apply(fn, recurse)

    def forward(self, x, mask):
        y = self.bn(self.conv(x)).mean(-1) * self.scale + self.shift
        return (y + torch.arange(3, device=x.device) + torch.ones(3, device=self.named).to(x.device)) * mask


def devices_named(named: str = "cpu") -> nn.Module:
    m = DevicesNamed(named)
    _seeded(m, 11)
    with torch.no_grad():  # running statistics that are not the identity, so BatchNorm matters
        m.bn.running_mean.copy_(torch.tensor([0.1, -0.2, 0.3]))
        m.bn.running_var.copy_(torch.tensor([1.5, 0.5, 2.0]))
    return m


def devices_named_inputs(rows: int, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, 5, generator=g), (torch.rand(rows, 3, generator=g) > 0.3).float()
