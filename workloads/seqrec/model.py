"""A SASRec-style generative recommender on jagged histories, with item embeddings in TorchRec.

Reads top to bottom like the model:

1. ``EmbeddingCollection`` (TorchRec; sharded by DMP under ``torchrun``) looks up sequence
   embeddings for every interaction's item and action, and for each history's sampled negatives
   (the ``negatives`` feature shares the item table).
2. :class:`SequenceEncoder`: input = item + action + position embedding; pre-norm transformer
   blocks with causal self-attention over each history. Everything except the attention scores
   runs on jagged values ``[Σ L, D]``. Attention pads *within a length bucket* (powers of two, so a
   history pads to less than twice its length) to the bucket's longest history, never to the
   batch's or the dataset's maximum (fbgemm ``jagged_to_padded_dense`` / ``dense_to_jagged``).
3. :class:`NextItemHead`: at every position but the last, score the next item against the
   history's sampled negatives (cosine / temperature, accidental hits masked): sampled softmax.

Per-rank compute time: :class:`DenseComputeTimer` measures steps 2–3, forward and backward, and
nothing else: it starts once the embeddings have arrived (after TorchRec's output all-to-all) and
stops when the gradient reaches the encoder's input (before the embedding backward all-to-all and
the dense gradient all-reduce). That is the time a balanced partition equalises.

Data parallelism of the dense part: :class:`DataParallelDense` sums its gradients over ranks in one
all-reduce (each rank's loss is already divided by the *global* target count), which also carries
every rank's compute time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm (jagged ops)
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor

from workloads.base import RunContext
from workloads.seqrec.batch import SeqBatch, build_batch
from workloads.seqrec.config import PRESETS, SeqRecShape  # noqa: F401 - PRESETS: the model's shapes, named here too
from workloads.seqrec.data import Histories


def build_embedding_collection(shape: SeqRecShape, device: torch.device) -> EmbeddingCollection:
    """Item table (features ``item_ids`` and ``negatives``) and action table (feature ``actions``)."""
    return EmbeddingCollection(
        tables=[
            EmbeddingConfig(name="item", embedding_dim=shape.embedding_dim, num_embeddings=shape.num_items,
                            feature_names=["item_ids", "negatives"]),
            EmbeddingConfig(name="action", embedding_dim=shape.embedding_dim, num_embeddings=shape.num_actions,
                            feature_names=["actions"]),
        ],
        device=device,
    )


class DenseComputeTimer:
    """Wall time of one step's dense forward + backward (module docstring), in seconds.

    On an accelerator every mark synchronises the device (4 per step), so the time is the
    device's, not the launch queue's.
    """

    def __init__(self, device: torch.device):
        self._sync = device.type != "cpu"
        self.forward_s = math.nan
        self.backward_s = math.nan
        self._mark = 0.0

    def _now(self) -> float:
        if self._sync:
            torch.accelerator.synchronize()
        return time.perf_counter()

    def forward_started(self) -> None:
        self.forward_s = self.backward_s = math.nan
        self._mark = self._now()

    def forward_finished(self, encoder_input: torch.Tensor, loss: torch.Tensor) -> None:
        self.forward_s = self._now() - self._mark
        if loss.requires_grad and encoder_input.requires_grad:
            loss.register_hook(self._backward_started)
            encoder_input.register_hook(self._backward_finished)

    def _backward_started(self, grad: torch.Tensor) -> None:
        self._mark = self._now()

    def _backward_finished(self, grad: torch.Tensor) -> None:
        self.backward_s = self._now() - self._mark

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s


def attention_buckets(lengths: list[int]) -> list[tuple[int, int, torch.Tensor, int]]:
    """Runs of consecutive histories in the same power-of-two length bucket.

    Each entry: (first token, end token, offsets of the run's histories from 0, longest length).
    Histories sorted longest first give one run per bucket; any order is correct.
    """
    buckets: list[tuple[int, int, torch.Tensor, int]] = []
    start, token, run = 0, 0, [0]
    for i, length in enumerate(lengths):
        run.append(run[-1] + length)
        token += length
        last = i + 1 == len(lengths)
        if last or (lengths[i + 1] - 1).bit_length() != (length - 1).bit_length():
            count = len(run) - 1
            buckets.append((start, token, torch.tensor(run), max(lengths[i + 1 - count: i + 1])))
            start, run = token, [0]
    return buckets


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention of each history over its own past."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x_td: torch.Tensor, buckets: list[tuple[int, int, torch.Tensor, int]]) -> torch.Tensor:
        qkv_t3d = self.qkv(x_td)
        dim, heads = x_td.shape[1], self.num_heads
        outputs = []
        for start, end, offsets, longest in buckets:
            offsets = offsets.to(x_td.device, non_blocking=True)
            qkv_bl3d = torch.ops.fbgemm.jagged_to_padded_dense(qkv_t3d[start:end], [offsets], [longest])
            count = qkv_bl3d.shape[0]
            q, k, v = qkv_bl3d.view(count, longest, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            # Histories are padded on the right: a real query only ever sees real keys under the causal mask.
            out_bhld = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out_bld = out_bhld.transpose(1, 2).reshape(count, longest, dim)
            outputs.append(torch.ops.fbgemm.dense_to_jagged(out_bld, [offsets], end - start)[0])
        return self.proj(torch.cat(outputs))


class Block(nn.Module):
    """Pre-norm transformer block: attention, then a GELU feed-forward, each with a residual."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = CausalSelfAttention(dim, num_heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x_td: torch.Tensor, buckets: list[tuple[int, int, torch.Tensor, int]]) -> torch.Tensor:
        x_td = x_td + self.attention(self.attention_norm(x_td), buckets)
        return x_td + self.ffn(self.ffn_norm(x_td))


class SequenceEncoder(nn.Module):
    """Position embeddings, causal blocks, final norm: one hidden state per interaction."""

    def __init__(self, shape: SeqRecShape):
        super().__init__()
        self.positions = nn.Embedding(shape.max_len, shape.embedding_dim)
        self.blocks = nn.ModuleList(Block(shape.embedding_dim, shape.num_heads) for _ in range(shape.num_layers))
        self.norm = nn.LayerNorm(shape.embedding_dim)

    def forward(self, x_td: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        positions = torch.ops.fbgemm.offsets_range(offsets, x_td.shape[0])
        buckets = attention_buckets(lengths.tolist())
        h_td = x_td + self.positions(positions)
        for block in self.blocks:
            h_td = block(h_td, buckets)
        return self.norm(h_td)


@dataclass
class StepOutput:
    """What the model returns beside the loss (TorchRec pipelines hand it back from ``progress``)."""

    loss_sum: torch.Tensor  # this rank's summed next-item loss (detached)
    samples: int
    tokens: int
    split: str
    index: int


def _wait(embeddings: Any) -> dict[str, JaggedTensor]:
    """A sharded collection returns an awaitable (TorchRec's output all-to-all); wait for it here."""
    return embeddings.wait() if hasattr(embeddings, "wait") else embeddings


class NextItemHead(nn.Module):
    """The dense part of the model: encoder + sampled-softmax next-item loss (module docstring)."""

    def __init__(self, shape: SeqRecShape, temperature: float, timer: DenseComputeTimer):
        super().__init__()
        self.encoder = SequenceEncoder(shape)
        self.temperature = temperature
        self.timer = timer
        self.last_loss_sum = torch.zeros(())  # this rank's loss sum of the latest forward (detached)

    def forward(self, embeddings: Any, batch: SeqBatch) -> tuple[torch.Tensor, StepOutput]:
        embeddings = _wait(embeddings)
        self.timer.forward_started()
        items, actions, negatives = embeddings["item_ids"], embeddings["actions"], embeddings["negatives"]
        lengths = items.lengths()
        x_td = items.values() + actions.values()
        h_td = self.encoder(x_td, lengths)
        loss_sum = self._sampled_softmax_sum(h_td, items, negatives, batch)
        loss = loss_sum / batch.num_targets
        self.last_loss_sum = loss_sum.detach()
        self.timer.forward_finished(x_td, loss)
        output = StepOutput(loss_sum.detach(), batch.samples, int(x_td.shape[0]), batch.split, batch.index)
        return loss, output

    def _sampled_softmax_sum(
        self, h_td: torch.Tensor, items: JaggedTensor, negatives: JaggedTensor, batch: SeqBatch
    ) -> torch.Tensor:
        """Σ over positions with a next item of −log softmax(positive vs the history's negatives)."""
        lengths, offsets = items.lengths(), items.offsets()
        is_source = torch.ones(h_td.shape[0], dtype=torch.bool, device=h_td.device)
        is_source[offsets[1:] - 1] = False  # the last interaction has no next item
        source = torch.nonzero(is_source).squeeze(1)
        h_sd = F.normalize(h_td[source], dim=-1)
        positive_sd = F.normalize(items.values()[source + 1], dim=-1)
        positive_logit = (h_sd * positive_sd).sum(-1, keepdim=True) / self.temperature
        count, num_negatives = lengths.shape[0], negatives.values().shape[0] // max(lengths.shape[0], 1)
        negative_bdk = F.normalize(negatives.values(), dim=-1).view(count, num_negatives, -1).transpose(1, 2)
        source_offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths - 1)
        negative_logit, _ = torch.ops.fbgemm.jagged_dense_bmm(
            h_sd, source_offsets, negative_bdk, int(lengths.max()) - 1
        )
        negative_logit = negative_logit / self.temperature
        # a sampled negative that is the true next item is no negative
        ids = batch.features["item_ids"].values()
        negative_ids = batch.features["negatives"].values().view(count, num_negatives)
        owner = torch.repeat_interleave(torch.arange(count, device=h_td.device), lengths - 1)
        negative_logit = negative_logit.masked_fill(negative_ids[owner] == ids[source + 1][:, None], -torch.inf)
        logits = torch.cat([positive_logit, negative_logit], dim=1)
        return (torch.logsumexp(logits, dim=1) - logits[:, 0]).sum()

    @torch.no_grad()
    def user_vectors(
        self, item_values: torch.Tensor, action_values: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Normalised hidden state after each history's last interaction, ``[users, D]``."""
        h_td = self.encoder(item_values + action_values, lengths)
        last = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)[1:] - 1
        return F.normalize(h_td[last], dim=-1)


class SeqRecModel(nn.Module):
    """``forward(batch) -> (loss, StepOutput)``: the shape TorchRec's train pipelines drive.

    The embedding collection reads ``batch.features`` directly, so ``TrainPipelineSparseDist``
    can issue the next batch's input all-to-all ahead of this batch's dense compute.
    """

    def __init__(self, embeddings: nn.Module, head: NextItemHead):
        super().__init__()
        self.embeddings = embeddings
        self.head = head

    def forward(self, batch: SeqBatch) -> tuple[torch.Tensor, StepOutput]:
        return self.head(self.embeddings(batch.features), batch)


class DataParallelDense:
    """The "optimizer" the TorchRec pipeline calls: sums dense gradients over ranks, then AdamW.

    The one all-reduce also carries this step's dense compute time (a slot per rank) and loss
    sum, so every rank learns every rank's time and the global loss at no extra collective.
    """

    def __init__(self, head: NextItemHead, optimizer: torch.optim.Optimizer, ctx: RunContext):
        self.head, self.optimizer, self.ctx = head, optimizer, ctx
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.rank_times_s = np.zeros(ctx.world_size)
        self.loss_sum = math.nan

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        ctx = self.ctx
        extras = torch.zeros(ctx.world_size + 1, device=ctx.device)  # float32: µs resolution up to minutes
        extras[ctx.rank] = self.head.timer.seconds
        extras[-1] = self.head.last_loss_sum.float()
        if ctx.distributed:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            flat = torch.cat([g.reshape(-1).float() for g in grads] + [extras])
            dist.all_reduce(flat, group=ctx.process_group)
            offset = 0
            for p, g in zip(self.params, grads, strict=True):
                p.grad = flat[offset: offset + g.numel()].view_as(g).to(g.dtype)
                offset += g.numel()
            extras = flat[offset:]
        extras = extras.cpu().numpy()
        self.rank_times_s, self.loss_sum = extras[:-1].copy(), float(extras[-1])
        self.optimizer.step()


def dense_training_flops(shape: SeqRecShape, lengths: list[int]) -> float:
    """Matmul FLOPs of the dense part's forward + backward (3× forward) for one rank batch."""
    dim, tokens = shape.embedding_dim, sum(lengths)
    per_token_per_layer = 2 * (3 * dim * dim + dim * dim + 8 * dim * dim)  # qkv, proj, ffn
    attention = sum(2 * length * length * dim for length in lengths)  # causal QKᵀ and AV: half of 2·2·L²·D
    loss = sum(2 * (length - 1) * (shape.num_negatives + 1) * dim for length in lengths)
    return 3.0 * (shape.num_layers * (tokens * per_token_per_layer) + shape.num_layers * attention + loss)


def time_dense_pass(head: NextItemHead, lengths: list[int], shape: SeqRecShape, repeats: int) -> float:
    """Fastest of ``repeats`` dense forward + backward times of a synthetic rank batch of ``lengths``.

    Random embeddings stand in for the looked-up ones (the dense cost does not depend on their
    values); co-tenants and stray threads only ever add time, so the minimum is the work itself.
    Leaves the head's gradients empty.
    """
    device = next(head.parameters()).device
    rng = np.random.default_rng(len(lengths) * 1009 + sum(lengths))
    tokens = sum(lengths)
    histories = Histories(np.asarray(lengths), rng.integers(shape.num_items, size=tokens),
                          rng.integers(shape.num_actions, size=tokens), np.zeros((len(lengths), 1)))
    negatives = rng.integers(shape.num_items, size=(len(lengths), shape.num_negatives))
    batch = build_batch(histories, negatives, tokens - len(lengths), "calibration", -1, shape.max_len).to(device)
    times = []
    for _ in range(repeats):
        embeddings = {}
        for key in ("item_ids", "actions", "negatives"):
            jagged = batch.features[key]
            values = torch.randn(jagged.values().shape[0], shape.embedding_dim, device=device, requires_grad=True)
            embeddings[key] = JaggedTensor(values=values, lengths=jagged.lengths())
        loss, _ = head(embeddings, batch)
        loss.backward()
        times.append(head.timer.seconds)
    head.zero_grad(set_to_none=True)
    return float(np.min(times))
