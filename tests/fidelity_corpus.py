"""Programs the replay was not designed around: the corpus that capture → replay → fidelity is judged on.

Each entry builds a small, self-contained training program as a newcomer would write it — model,
data, optimiser — and returns ``(step, model)``: ``step()`` runs one training iteration. They
cover the op families a replay must get right: convolutions with batch norm and pooling, a
recurrent net, attention with padding masks, top-k routing with gather/scatter on computed
indices, embedding bags with per-sample weights, scatter-reduce message passing, bf16 autocast
with gradient clipping, a model run through ``torch.compile``, and a conv1d + LSTM + masked-attention
model whose loss reads rows selected by a data-dependent mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Program = tuple[Callable[[], None], nn.Module]


def _trainer(model: nn.Module, loss_fn: Callable[[], torch.Tensor], lr: float = 1e-3,
             clip: float | None = None) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step() -> None:
        loss = loss_fn()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def cnn_batchnorm() -> Program:
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    return _trainer(model, lambda: F.cross_entropy(model(x), y)), model


def gru_tagger() -> Program:
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(200, 32)
            self.gru = nn.GRU(32, 48, batch_first=True, num_layers=2)
            self.out = nn.Linear(48, 12)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            hidden, _ = self.gru(self.emb(tokens))
            return self.out(hidden)

    model = Tagger()
    tokens, tags = torch.randint(0, 200, (8, 24)), torch.randint(0, 12, (8, 24))
    return _trainer(model, lambda: F.cross_entropy(model(tokens).flatten(0, 1), tags.flatten())), model


def transformer_padding_mask() -> Program:
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    x = torch.randn(8, 20, 64)
    lengths = torch.tensor([20, 18, 15, 20, 9, 12, 20, 5])
    pad = torch.arange(20)[None, :] >= lengths[:, None]  # True where padded

    def loss() -> torch.Tensor:
        out = model(x, src_key_padding_mask=pad)
        return out.masked_fill(pad[..., None], 0.0).pow(2).mean()

    return _trainer(model, loss), model


def moe_topk_routing() -> Program:
    class MoE(nn.Module):
        def __init__(self, dim: int = 32, experts: int = 4, k: int = 2) -> None:
            super().__init__()
            self.k = k
            self.router = nn.Linear(dim, experts, bias=False)
            self.w1 = nn.Parameter(torch.randn(experts, dim, 64) * 0.05)
            self.w2 = nn.Parameter(torch.randn(experts, 64, dim) * 0.05)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            weights, chosen = self.router(x).softmax(-1).topk(self.k, dim=-1)  # (tokens, k)
            flat = chosen.flatten()
            order = flat.argsort()
            token_of = order // self.k
            counts = torch.bincount(flat, minlength=self.w1.shape[0]).tolist()
            outs = []
            for e, rows in enumerate(token_of.split(counts)):
                h = F.silu(x.index_select(0, rows) @ self.w1[e])
                outs.append(h @ self.w2[e])
            y = torch.cat(outs) * weights.flatten()[order, None]
            return torch.zeros_like(x).scatter_add_(0, token_of[:, None].expand(-1, x.shape[1]), y)

    model = MoE()
    x = torch.randn(64, 32)
    return _trainer(model, lambda: model(x).pow(2).mean()), model


def embedding_bag_weighted() -> Program:
    class Bags(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(1000, 32, mode="sum")
            self.head = nn.Linear(32, 1)

        def forward(self, ids, offsets, weights):
            return self.head(self.bag(ids, offsets, per_sample_weights=weights))

    model = Bags()
    ids, offsets = torch.randint(0, 1000, (256,)), torch.arange(0, 256, 8)
    weights, target = torch.rand(256), torch.rand(32, 1)
    return _trainer(model, lambda: F.mse_loss(model(ids, offsets, weights), target)), model


def gnn_scatter_reduce() -> Program:
    class MessagePassing(nn.Module):
        def __init__(self, dim: int = 32) -> None:
            super().__init__()
            self.msg = nn.Linear(dim, dim)
            self.update = nn.Linear(2 * dim, dim)

        def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
            src, dst = edges
            messages = self.msg(x).index_select(0, src)
            agg = torch.zeros_like(x).scatter_reduce(0, dst[:, None].expand(-1, x.shape[1]), messages,
                                                     reduce="amax", include_self=False)
            return F.relu(self.update(torch.cat([x, agg], dim=1)))

    model = MessagePassing()
    x, edges = torch.randn(100, 32), torch.randint(0, 100, (2, 400))
    return _trainer(model, lambda: model(x, edges).mean()), model


def bf16_autocast_clip() -> Program:
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 64))
    x, y = torch.randn(32, 64), torch.randn(32, 64)

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        return F.mse_loss(out.float(), y)

    return _trainer(model, loss, clip=1.0), model


def compiled_mlp() -> Program:
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    compiled = torch.compile(model)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    return _trainer(model, lambda: F.cross_entropy(compiled(x), y)), model


def conv_lstm_masked_attention() -> Program:
    """Written the way a newcomer would: conv1d, an LSTM, attention with a boolean key-padding mask from
    random lengths, masked_fill, torch.where on a confidence mask, and the loss over ``logits[valid]``."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(16, 32, 3, padding=1)
            self.lstm = nn.LSTM(32, 32, batch_first=True)
            self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
            self.head = nn.Linear(32, 10)

        def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
            h = F.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
            h, _ = self.lstm(h)
            h, _ = self.attn(h, h, h, key_padding_mask=pad)
            return self.head(h.masked_fill(pad.unsqueeze(-1), 0.0))

    model = Net()

    def loss() -> torch.Tensor:
        x, y = torch.randn(16, 48, 16), torch.randint(0, 10, (16, 48))
        pad = torch.arange(48)[None, :] >= torch.randint(12, 49, (16,))[:, None]
        logits = model(x, pad)
        confident = logits.softmax(-1).amax(-1) > 0.2
        logits = torch.where(confident.unsqueeze(-1), logits, logits * 0.5)
        valid = ~pad
        return F.cross_entropy(logits[valid], y[valid])

    return _trainer(model, loss), model


PROGRAMS: dict[str, Callable[[], Program]] = {
    "cnn_batchnorm": cnn_batchnorm,
    "gru_tagger": gru_tagger,
    "transformer_padding_mask": transformer_padding_mask,
    "moe_topk_routing": moe_topk_routing,
    "embedding_bag_weighted": embedding_bag_weighted,
    "gnn_scatter_reduce": gnn_scatter_reduce,
    "bf16_autocast_clip": bf16_autocast_clip,
    "compiled_mlp": compiled_mlp,
    "conv_lstm_masked_attention": conv_lstm_masked_attention,
}
