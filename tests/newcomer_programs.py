"""Training programs written the way newcomers write them, each around a pattern the replay was not built on.

Each entry builds a small, self-contained training program — model, data, optimiser — and returns
``(step, model)``: ``step()`` runs one training iteration. Together they cover what the other corpora
do not: complex tensors through FFTs, activation checkpointing (its forward run again in the backward),
gradient accumulation over micro-batches, sampling (reparameterisation, a Normal's KL, ``Categorical``,
``multinomial``, Gumbel-softmax, inverse-CDF ``searchsorted``), linear algebra (Cholesky solves), a second-order
gradient penalty, a custom ``autograd.Function``, parametrizations (spectral and weight norm), channels-last
convolutions with a fused optimiser, ``nn.TransformerEncoder`` with a padding mask, CTC, fp16 autocast
with a ``GradScaler``, an EMA of the weights by ``_foreach_lerp_``, ``one_hot`` with its width read from
the labels, hard-negative mining, ``bucketize``, an embedding renormalised by ``max_norm``, packed
sequences through a GRU, max-unpooling by pooling's indices, a spatial transformer (``grid_sample``),
``scatter_reduce`` pooling, gradient clipping with a one-cycle schedule, bfloat16 autocast, ``unfold``/``fold``
with ``roll``, ``cummax``/``kthvalue``/stable-sort indices, a weighted ``EmbeddingBag`` with padding,
``pad_sequence`` with an attention mask, ``eigh`` whitening, ``interpolate`` with ``pixel_shuffle``; and
vector quantisation (``cdist``, ``argmin``, ``bincount``), ragged splits by ``tolist()`` lengths, segment means by
``unique``, ``masked_scatter``, pruning hooks beside an orthogonal parametrization, position ids from a mask's
``cumsum`` with ``ignore_index``, sorting by length and back, a sparse adjacency built each step, ``topk`` through
``take_along_dim`` with ``quantile``, batched ``linalg.solve`` and ``qr``, a causal ``TransformerDecoder``, rows by
``nonzero`` with ``index_copy``, sparse embedding gradients under ``SparseAdam``, attention with a float mask and
per-head weights, a max-mode ``EmbeddingBag``, 3-D convolutions, transposed convolutions with group and instance
norm, ``LBFGS`` with a line search, ``stft``/``istft``, a branch on ``loss.item()``, ``index_put`` accumulating into
a grid, hashed feature crosses, stacked bidirectional RNNs and a projected LSTM, sliding-window scans, a
Hessian-vector product, ``take``/``put_`` and ``scatter_reduce("amax")``, InfoNCE, a hidden state carried across
batches; and an adaptive softmax over clusters, a bias per class within its cluster by ``index_select``,
Dirichlet/Beta samples and a mixture, the full ``nn.Transformer``,
an ``LSTMCell`` decoder with teacher forcing, ``unique`` over rows, ``index_reduce``, a private ``Generator``, mixup
and CutMix, a GRU over a random crop, fake quantisation, five more optimisers, a plateau scheduler, dead units
re-initialised by a mask, ``svdvals``/``lstsq``/``slogdet``/``matrix_exp``, complex tensors by ``polar``, NaN
targets masked, float64 with dropout variants, a medley of losses, ``Bilinear`` with pixel and channel shuffles,
``cdist``/``pdist``, an optimiser by ``_foreach_`` ops, ``functional_call``, double DQN, PPO, a tanh-squashed
policy, gradient and module hooks, unsorted packed sequences, grouped-query attention, ``tril_indices``,
``argwhere``, parameters as one vector, Gaussian NLL with a triplet distance, attention over other key widths,
weight clipping, volumetric ``grid_sample``, frequency-scaled embedding gradients, ``torch.compile``; and experts
with a capacity (places by ``cumsum``, dispatch by ``einsum``), scheduled sampling feeding a decoder its own
``argmax``, and MAE's random masking by ``argsort`` and ``gather``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence

Program = tuple[Callable[[], None], nn.Module]


def _trainer(model: nn.Module, loss: Callable[[], torch.Tensor], opt: torch.optim.Optimizer | None = None
             ) -> Callable[[], None]:
    opt = opt or torch.optim.SGD(model.parameters(), lr=1e-2)

    def step() -> None:
        loss().backward()
        opt.step()
        opt.zero_grad()

    return step


def fno_spectral() -> Program:
    """A Fourier neural operator layer: complex weights on the lowest modes of an ``rfft2``."""
    class Spectral(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = nn.Parameter(torch.randn(8, 8, 6, 6, dtype=torch.cfloat) * 0.1)
            self.lift, self.proj = nn.Conv2d(1, 8, 1), nn.Conv2d(8, 1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lift(x)
            modes = torch.fft.rfft2(h)
            out = torch.zeros_like(modes)
            out[:, :, :6, :6] = torch.einsum("bixy,ioxy->boxy", modes[:, :, :6, :6], self.weights)
            return self.proj(F.gelu(torch.fft.irfft2(out, s=h.shape[-2:]) + h))

    model = Spectral()
    x, y = torch.randn(4, 1, 24, 24), torch.randn(4, 1, 24, 24)
    return _trainer(model, lambda: F.mse_loss(model(x), y), torch.optim.Adam(model.parameters(), 1e-3)), model


def checkpointed_mlp() -> Program:
    from torch.utils.checkpoint import checkpoint

    blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64)) for _ in range(3))
    x, y = torch.randn(32, 64), torch.randn(32, 64)

    def loss() -> torch.Tensor:
        h = x
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return F.mse_loss(h, y)

    return _trainer(blocks, loss, torch.optim.AdamW(blocks.parameters(), 1e-3)), blocks


def grad_accumulation() -> Program:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters())

    def step() -> None:
        for _ in range(3):
            x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
            (F.cross_entropy(model(x), y) / 3).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, model


def vae_reparameterised() -> Program:
    encoder, decoder = nn.Linear(64, 16), nn.Linear(8, 64)
    model = nn.ModuleList([encoder, decoder])
    x = (torch.rand(16, 64) > 0.5).float()

    def loss() -> torch.Tensor:
        mu, logvar = encoder(x).chunk(2, -1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        reconstruction = F.binary_cross_entropy_with_logits(decoder(z), x, reduction="sum")
        return reconstruction - 0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())

    return _trainer(model, loss, torch.optim.Adam(model.parameters(), 1e-3)), model


def policy_gradient() -> Program:
    policy = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 5))

    def loss() -> torch.Tensor:
        dist = torch.distributions.Categorical(logits=policy(torch.randn(20, 10)))
        action = dist.sample()
        reward = (action == 2).float() - 0.5
        return -(dist.log_prob(action) * reward).mean() - 0.01 * dist.entropy().mean()

    return _trainer(policy, loss), policy


def normal_kl_categorical_actions() -> Program:
    """A Normal's ``rsample`` and its KL to a prior, then a ``Categorical`` over many actions sampled and scored
    by ``log_prob`` (the sampled actions broadcast against the logits, one column gathered)."""
    encoder, head = nn.Linear(10, 8), nn.Linear(4, 32)
    model = nn.ModuleList([encoder, head])

    def loss() -> torch.Tensor:
        h = encoder(torch.randn(64, 10))
        q = torch.distributions.Normal(h[:, :4], h[:, 4:].clamp(-3, 3).exp())
        z = q.rsample()
        prior = torch.distributions.Normal(torch.zeros_like(z), torch.ones_like(z))
        kl = torch.distributions.kl_divergence(q, prior).sum(1)
        actions = torch.distributions.Categorical(logits=head(z))
        taken = actions.sample()
        return (kl - actions.log_prob(taken) * z.sum(1).detach()).mean() - 0.01 * actions.entropy().mean()

    return _trainer(model, loss), model


def multinomial_from_kept_probabilities() -> Program:
    """``multinomial`` over a probability table the program keeps, and over its own softmax."""
    lin = nn.Linear(50, 50)
    table = torch.softmax(torch.randn(64, 50) * 3, -1)

    def loss() -> torch.Tensor:
        p = F.softmax(lin(torch.randn(64, 50)), -1)
        picked = torch.multinomial(table, 4)
        own = torch.multinomial(p.detach(), 3, replacement=False)
        return -torch.log(p.gather(1, own)).mean() + p.gather(1, picked).mean() + F.binary_cross_entropy(p, table)

    return _trainer(lin, loss), lin


def gaussian_process_cholesky() -> Program:
    features = nn.Linear(5, 8)
    x, y = torch.randn(30, 5), torch.randn(30, 1)

    def loss() -> torch.Tensor:
        h = features(x)
        factor = torch.linalg.cholesky(h @ h.T + 0.1 * torch.eye(30))
        return 0.5 * (y * torch.cholesky_solve(y, factor)).sum() + torch.log(torch.diagonal(factor)).sum()

    return _trainer(features, loss), features


def sdpa_causal_dropout() -> Program:
    qkv, out = nn.Linear(32, 96), nn.Linear(32, 32)
    model = nn.ModuleList([qkv, out])
    x = torch.randn(4, 16, 32)

    def loss() -> torch.Tensor:
        q, k, v = qkv(x).view(4, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
        return out(attended.transpose(1, 2).reshape(4, 16, 32)).pow(2).mean()

    return _trainer(model, loss), model


def spectral_and_weight_norm() -> Program:
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    model = nn.Sequential(spectral_norm(nn.Linear(24, 24)), nn.ReLU(), weight_norm(nn.Linear(24, 3)))
    x, y = torch.randn(16, 24), torch.randint(0, 3, (16,))
    return _trainer(model, lambda: F.cross_entropy(model(x), y)), model


def channels_last_fused_adam() -> Program:
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 3), nn.Flatten(),
                          nn.Linear(8 * 16 * 16, 5)).to(memory_format=torch.channels_last)
    x, y = torch.randn(8, 3, 20, 20).to(memory_format=torch.channels_last), torch.randint(0, 5, (8,))
    opt = torch.optim.Adam(model.parameters(), 1e-3, fused=True)
    return _trainer(model, lambda: F.cross_entropy(model(x), y), opt), model


def transformer_encoder_padding() -> Program:
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.1)
    encoder, head = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(32, 3)
    model = nn.ModuleList([encoder, head])

    def loss() -> torch.Tensor:
        pad = torch.arange(14)[None] >= torch.randint(4, 15, (6, 1))
        h = encoder(torch.randn(6, 14, 32), src_key_padding_mask=pad)
        return F.cross_entropy(head(h[~pad]), torch.randint(0, 3, (int((~pad).sum()),)))

    return _trainer(model, loss, torch.optim.AdamW(model.parameters(), 1e-3)), model


def searchsorted_sampling() -> Program:
    lin = nn.Linear(8, 16)

    def loss() -> torch.Tensor:
        w = F.softplus(lin(torch.randn(10, 8))) + 1e-3
        cdf = torch.cumsum(w, -1)
        idx = torch.searchsorted((cdf / cdf[:, -1:]).detach(), torch.rand(10, 6)).clamp(max=15)
        return -torch.log(torch.gather(w / w.sum(-1, keepdim=True), 1, idx)).mean()

    return _trainer(lin, loss), lin


def embedding_max_norm() -> Program:
    emb, head = nn.Embedding(100, 16, max_norm=1.0), nn.Linear(16, 2)
    model = nn.ModuleList([emb, head])

    def loss() -> torch.Tensor:
        return F.cross_entropy(head(emb(torch.randint(0, 100, (32, 5))).mean(1)), torch.randint(0, 2, (32,)))

    return _trainer(model, loss), model


def ctc_bidirectional_lstm() -> Program:
    lstm, head = nn.LSTM(20, 32, bidirectional=True), nn.Linear(64, 6)
    model = nn.ModuleList([lstm, head])

    def loss() -> torch.Tensor:
        log_probs = head(lstm(torch.randn(30, 4, 20))[0]).log_softmax(-1)
        lengths = torch.randint(3, 8, (4,))
        targets = torch.randint(1, 6, (int(lengths.sum()),))
        return F.ctc_loss(log_probs, targets, torch.full((4,), 30), lengths)

    return _trainer(model, loss, torch.optim.Adam(model.parameters())), model


def fp16_autocast_grad_scaler() -> Program:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt, scaler = torch.optim.SGD(model.parameters(), 0.01), torch.amp.GradScaler("cpu")
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    return step, model


def one_hot_width_from_labels() -> Program:
    lin = nn.Linear(12, 7)

    def loss() -> torch.Tensor:
        target = F.one_hot(torch.randint(0, 7, (40,))).float()  # as wide as the largest label drawn
        return F.mse_loss(lin(torch.randn(40, 12))[:, :target.shape[1]], target)

    return _trainer(lin, loss), lin


def wgan_gradient_penalty() -> Program:
    critic = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt = torch.optim.Adam(critic.parameters(), 1e-4)
    real, fake = torch.randn(24, 16), torch.randn(24, 16)

    def step() -> None:
        a = torch.rand(24, 1)
        mixed = (a * real + (1 - a) * fake).requires_grad_(True)
        grad, = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
        penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
        (critic(fake).mean() - critic(real).mean() + 10 * penalty).backward()
        opt.step()
        opt.zero_grad()

    return step, critic


def custom_autograd_function() -> Program:
    class Swish(torch.autograd.Function):
        @staticmethod
        def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
            s = torch.sigmoid(x)
            ctx.save_for_backward(x, s)
            return x * s

        @staticmethod
        def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
            x, s = ctx.saved_tensors
            return grad * (s * (1 + x * (1 - s)))

    first, second = nn.Linear(20, 40), nn.Linear(40, 3)
    model = nn.ModuleList([first, second])
    x, y = torch.randn(32, 20), torch.randint(0, 3, (32,))
    return _trainer(model, lambda: F.cross_entropy(second(Swish.apply(first(x))), y)), model


def ema_of_the_weights() -> Program:
    model = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 32))
    ema = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    x = torch.randn(16, 32)

    def step() -> None:
        F.mse_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            torch._foreach_lerp_(ema, list(model.parameters()), 0.001)

    return step, model


def gumbel_hard_routing() -> Program:
    gate, experts = nn.Linear(16, 4), nn.Linear(16, 64)
    model = nn.ModuleList([gate, experts])
    x = torch.randn(30, 16)

    def loss() -> torch.Tensor:
        weights = F.gumbel_softmax(gate(x), tau=0.5, hard=True)
        return (experts(x).view(30, 4, 16) * weights[..., None]).sum(1).pow(2).mean()

    return _trainer(model, loss), model


def triplet_hard_mining() -> Program:
    encoder = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 8))
    x, labels = torch.randn(40, 10), torch.randint(0, 5, (40,))

    def loss() -> torch.Tensor:
        e = F.normalize(encoder(x), dim=1)
        distance, same = torch.cdist(e, e), labels[:, None] == labels[None]
        hardest_positive, hardest_negative = (distance * same).argmax(1), (distance + same * 1e3).argmin(1)
        return F.triplet_margin_loss(e, e[hardest_positive], e[hardest_negative], margin=0.2)

    return _trainer(encoder, loss), encoder


def focal_loss_label_smoothing() -> Program:
    lin = nn.Linear(24, 9)
    x, y = torch.randn(50, 24), torch.randint(0, 9, (50,))

    def loss() -> torch.Tensor:
        ce = F.cross_entropy(lin(x), y, reduction="none", label_smoothing=0.1)
        return ((1 - torch.exp(-ce)) ** 2 * ce).mean()

    return _trainer(lin, loss), lin


def bucketized_feature() -> Program:
    emb, head = nn.Embedding(11, 8), nn.Linear(8, 1)
    model = nn.ModuleList([emb, head])
    edges = torch.linspace(-2, 2, 10)

    def loss() -> torch.Tensor:
        v = torch.randn(64)
        return F.mse_loss(head(emb(torch.bucketize(v, edges))).squeeze(1), v)

    return _trainer(model, loss), model


def packed_gru() -> Program:
    """A GRU over ``pack_padded_sequence`` of random lengths (unsorted), the last valid output of each row."""
    gru, head = nn.GRU(6, 12, batch_first=True), nn.Linear(12, 4)
    model = nn.ModuleList([gru, head])

    def loss() -> torch.Tensor:
        lengths = torch.randint(2, 15, (5,))
        x = torch.randn(5, 14, 6)
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, h = gru(packed)
        out, lens = pad_packed_sequence(out, batch_first=True)
        last = out[torch.arange(5), lens - 1]
        return F.cross_entropy(head(last), torch.randint(0, 4, (5,)))

    return _trainer(model, loss), model


def maxpool_unpool_autoencoder() -> Program:
    """Max pooling's indices fed to ``MaxUnpool2d``."""
    enc, dec = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 1, 3, padding=1)
    pool, unpool = nn.MaxPool2d(2, return_indices=True), nn.MaxUnpool2d(2)
    model = nn.ModuleList([enc, dec])
    x = torch.randn(3, 1, 16, 16)

    def loss() -> torch.Tensor:
        h, idx = pool(F.relu(enc(x)))
        return F.mse_loss(dec(unpool(h, idx)), x)

    return _trainer(model, loss), model


def spatial_transformer() -> Program:
    """A spatial transformer: ``affine_grid`` from a localisation net, then ``grid_sample``."""
    loc = nn.Sequential(nn.Flatten(), nn.Linear(144, 6))
    head = nn.Sequential(nn.Flatten(), nn.Linear(144, 3))
    model = nn.ModuleList([loc, head])

    def loss() -> torch.Tensor:
        x = torch.randn(4, 1, 12, 12)
        theta = loc(x).view(-1, 2, 3) + torch.tensor([[1., 0, 0], [0, 1., 0]])
        grid = F.affine_grid(theta, x.shape, align_corners=False)
        return F.cross_entropy(head(F.grid_sample(x, grid, align_corners=False)), torch.randint(0, 3, (4,)))

    return _trainer(model, loss), model


def scatter_reduce_graph_pool() -> Program:
    """Graph pooling by ``scatter_reduce("amax")`` and a mean by ``index_add_`` over random batch ids."""
    lin, head = nn.Linear(8, 16), nn.Linear(16, 1)
    model = nn.ModuleList([lin, head])

    def loss() -> torch.Tensor:
        nodes = torch.randn(60, 8)
        graph = torch.randint(0, 6, (60,)).sort().values
        h = F.relu(lin(nodes))
        pooled = torch.zeros(6, 16).scatter_reduce(0, graph[:, None].expand(-1, 16), h, "amax", include_self=False)
        mean = torch.zeros(6, 16).index_add_(0, graph, h) / torch.bincount(graph, minlength=6).clamp(min=1)[:, None]
        return F.mse_loss(head(pooled + mean).squeeze(1), torch.randn(6))

    return _trainer(model, loss), model


def clip_grad_onecycle() -> Program:
    """AdamW with ``clip_grad_norm_`` and a ``OneCycleLR`` stepped every step."""
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10_000)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()

    return step, model


def bf16_autocast_cpu() -> Program:
    """bfloat16 autocast on the CPU."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 5))
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        opt.step()
        opt.zero_grad()

    return step, model


def unfold_patches_roll() -> Program:
    """Reflect padding, ``unfold`` into patches, ``roll``, ``fold`` back."""
    proj = nn.Linear(3 * 16, 3 * 16)
    x = torch.randn(2, 3, 16, 16)

    def loss() -> torch.Tensor:
        padded = F.pad(x, (2, 2, 2, 2), mode="reflect")
        patches = F.unfold(padded, 4, stride=4)  # (2, 48, 25)
        mixed = proj(torch.roll(patches, shifts=1, dims=2).transpose(1, 2)).transpose(1, 2)
        back = F.fold(mixed, (20, 20), 4, stride=4)
        return F.mse_loss(back[..., 2:-2, 2:-2], x.flip(-1))

    return _trainer(proj, loss), proj


def cummax_kthvalue_sort() -> Program:
    """``cummax``'s indices gathered, ``kthvalue``, a stable sort's indices gathered."""
    lin = nn.Linear(10, 10)

    def loss() -> torch.Tensor:
        h = lin(torch.randn(8, 10))
        running, where = torch.cummax(h, dim=1)
        kth = torch.kthvalue(h, 3, dim=1).values
        order = torch.sort(h.detach(), dim=1, stable=True).indices
        return (running.gather(1, where) - kth[:, None]).pow(2).mean() + h.gather(1, order[:, :4]).mean()

    return _trainer(lin, loss), lin


def embedding_bag_weighted_padding() -> Program:
    """An ``EmbeddingBag`` with ``per_sample_weights`` and ``padding_idx``, offsets from random lengths."""
    bag, head = nn.EmbeddingBag(50, 8, mode="sum", padding_idx=0), nn.Linear(8, 1)
    model = nn.ModuleList([bag, head])

    def loss() -> torch.Tensor:
        lengths = torch.randint(1, 6, (12,))
        ids = torch.randint(0, 50, (int(lengths.sum()),))
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        weights = torch.rand(ids.numel())
        return head(bag(ids, offsets, per_sample_weights=weights)).pow(2).mean()

    return _trainer(model, loss), model


def pad_sequence_sdpa_mask() -> Program:
    """``pad_sequence`` of random lengths, a boolean ``attn_mask`` to SDPA, ``masked_fill``."""
    qkv, out = nn.Linear(16, 48), nn.Linear(16, 2)
    model = nn.ModuleList([qkv, out])

    def loss() -> torch.Tensor:
        lengths = torch.randint(3, 11, (4,))
        seqs = pad_sequence([torch.randn(int(n), 16) for n in lengths], batch_first=True)
        keep = torch.arange(seqs.shape[1])[None, :] < lengths[:, None]
        q, k, v = qkv(seqs).chunk(3, -1)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, :])
        att = att.masked_fill(~keep[..., None], 0.0)
        pooled = att.sum(1) / lengths[:, None]
        return F.cross_entropy(out(pooled), torch.randint(0, 2, (4,)))

    return _trainer(model, loss), model


def eigh_whitening() -> Program:
    """Whitening by ``linalg.eigh`` of a covariance computed every step."""
    lin = nn.Linear(12, 12)

    def loss() -> torch.Tensor:
        h = lin(torch.randn(64, 12))
        centred = h - h.mean(0)
        cov = centred.T @ centred / 63 + 1e-3 * torch.eye(12)
        vals, vecs = torch.linalg.eigh(cov)
        white = centred @ vecs / vals.sqrt()
        return (white.T @ white / 63 - torch.eye(12)).pow(2).mean() + h.pow(2).mean()

    return _trainer(lin, loss), lin


def interpolate_pixel_shuffle() -> Program:
    """Bilinear and nearest ``interpolate``, ``pixel_shuffle``."""
    down, up = nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.Conv2d(8, 12, 3, padding=1)
    model = nn.ModuleList([down, up])
    x = torch.randn(2, 3, 16, 16)

    def loss() -> torch.Tensor:
        h = F.interpolate(F.relu(down(x)), scale_factor=2, mode="bilinear", align_corners=False)
        h = F.interpolate(h, size=(8, 8), mode="nearest")
        return F.mse_loss(F.pixel_shuffle(up(h), 2), x)

    return _trainer(model, loss), model


def vq_codebook_straight_through() -> Program:
    """Vector quantisation: ``cdist`` to a codebook, ``argmin`` codes gathered, their use counted by ``bincount``,
    the straight-through estimator."""
    encoder, decoder = nn.Linear(32, 16), nn.Linear(16, 32)
    model = nn.ModuleDict({"encoder": encoder, "decoder": decoder})
    model.register_parameter("book", nn.Parameter(torch.randn(64, 16)))

    def loss() -> torch.Tensor:
        x = torch.randn(128, 32)
        z = encoder(x)
        codes = torch.cdist(z, model.book).argmin(1)
        q = model.book[codes]
        usage = torch.bincount(codes, minlength=64).float()
        through = z + (q - z).detach()
        return F.mse_loss(decoder(through), x) + F.mse_loss(q, z.detach()) + 0.25 * F.mse_loss(z, q.detach()) \
            + 1e-3 * usage.std()

    return _trainer(model, loss), model


def ragged_split_by_lengths() -> Program:
    """Rows split into ragged groups by lengths read with ``tolist()``, each group max-pooled."""
    lin = nn.Linear(8, 8)

    def loss() -> torch.Tensor:
        lengths = torch.randint(1, 10, (12,))
        parts = torch.split(lin(torch.randn(int(lengths.sum()), 8)), lengths.tolist())
        return torch.stack([p.max(0).values for p in parts]).pow(2).mean()

    return _trainer(lin, loss), lin


def segment_means_by_unique() -> Program:
    """Segment means: ``unique`` with its inverse and counts, ``index_add_``, ``repeat_interleave`` by the counts."""
    lin = nn.Linear(6, 6)

    def loss() -> torch.Tensor:
        ids = torch.randint(0, 20, (200,))
        x = lin(torch.randn(200, 6))
        kept, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        means = torch.zeros(len(kept), 6).index_add_(0, inverse, x) / counts.unsqueeze(1)
        return (means.repeat_interleave(counts, 0) - x.sort(0).values).pow(2).mean()

    return _trainer(lin, loss), lin


def masked_scatter_index_fill() -> Program:
    """``masked_scatter`` of as many values as a mask holds, ``index_fill`` of two columns."""
    lin = nn.Linear(10, 10)

    def loss() -> torch.Tensor:
        x = torch.randn(50, 10)
        mask = x > 0.5
        y = lin(x).masked_scatter(mask, torch.randn(int(mask.sum())))
        return y.index_fill(1, torch.tensor([0, 3]), 0.0).pow(2).mean()

    return _trainer(lin, loss), lin


def pruned_and_orthogonal() -> Program:
    """A layer pruned by ``prune.l1_unstructured`` (its mask applied by a forward pre-hook) beside an
    ``orthogonal`` parametrization."""
    from torch.nn.utils import prune
    from torch.nn.utils.parametrizations import orthogonal

    model = nn.Sequential(nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 4))
    prune.l1_unstructured(model[2], "weight", amount=0.4)
    orthogonal(model[0])

    def loss() -> torch.Tensor:
        return F.cross_entropy(model(torch.randn(16, 12)), torch.randint(0, 4, (16,)))

    return _trainer(model, loss), model


def positions_from_attention_mask() -> Program:
    """Position ids from the attention mask's ``cumsum`` (as Hugging Face models make them), padding labelled
    ``-100`` and left out by ``ignore_index``."""
    tokens_in, positions, head = nn.Embedding(50, 16), nn.Embedding(32, 16), nn.Linear(16, 50)
    model = nn.ModuleList([tokens_in, positions, head])

    def loss() -> torch.Tensor:
        tokens = torch.randint(0, 50, (4, 32))
        attention = (torch.rand(4, 32) > 0.2).long()
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0) * attention
        labels = tokens.masked_fill(attention == 0, -100)
        logits = head(tokens_in(tokens) + positions(position_ids))
        return F.cross_entropy(logits.view(-1, 50), labels.view(-1), ignore_index=-100)

    return _trainer(model, loss), model


def sort_by_length_and_back() -> Program:
    """Rows sorted by random lengths with ``argsort``, through an LSTM, put back by the inverse permutation."""
    rnn = nn.LSTM(6, 8, batch_first=True)

    def loss() -> torch.Tensor:
        order = torch.randint(1, 8, (10,)).argsort(descending=True)
        out, (h, _) = rnn(torch.randn(10, 7, 6).index_select(0, order))
        return h[-1].index_select(0, order.argsort()).pow(2).mean() + out.mean()

    return _trainer(rnn, loss), rnn


def sparse_adjacency_gcn() -> Program:
    """A graph convolution by ``torch.sparse.mm`` with a degree-normalised ``sparse_coo_tensor`` built each step
    from random edges."""
    lin = nn.Linear(16, 16)

    def loss() -> torch.Tensor:
        src, dst = torch.randint(0, 40, (160,)), torch.randint(0, 40, (160,))
        degree = torch.bincount(dst, minlength=40).float().clamp(min=1)
        adjacency = torch.sparse_coo_tensor(torch.stack([dst, src]), 1.0 / degree[dst], (40, 40))
        return torch.sparse.mm(adjacency, lin(torch.randn(40, 16))).relu().sum(1).var()

    return _trainer(lin, loss), lin


def topk_take_along_quantile() -> Program:
    """``topk`` indices through ``take_along_dim``, a ``quantile`` threshold for ``where``, a ``histc``."""
    lin = nn.Linear(20, 20)

    def loss() -> torch.Tensor:
        y = lin(torch.randn(30, 20))
        top = torch.take_along_dim(y, y.topk(5, dim=1).indices, dim=1)
        q = torch.quantile(y.detach(), 0.9, dim=1, keepdim=True)
        counts = torch.histc(y.detach(), bins=10)
        return (top - q).pow(2).mean() + y.where(y > q, torch.zeros(())).mean() + 1e-4 * counts.max()

    return _trainer(lin, loss), lin


def batched_solve_and_qr() -> Program:
    """A batched ``linalg.solve`` and the ``linalg.qr`` of a weight, both differentiated."""
    lin = nn.Linear(6, 6)

    def loss() -> torch.Tensor:
        a = torch.randn(8, 6, 6) + 6 * torch.eye(6)
        x = torch.linalg.solve(a, lin(torch.randn(8, 6)).unsqueeze(-1))
        _, r = torch.linalg.qr(lin.weight)
        return x.pow(2).mean() + 1e-3 * r.diagonal().abs().log().sum()

    return _trainer(lin, loss), lin


def transformer_decoder_causal() -> Program:
    """``nn.TransformerDecoder`` with a causal target mask and a random memory padding mask."""
    model = nn.TransformerDecoder(nn.TransformerDecoderLayer(32, 4, 64, batch_first=True, dropout=0.1), 2)

    def loss() -> torch.Tensor:
        padding = torch.rand(4, 9) < 0.2
        padding[:, 0] = False
        out = model(torch.randn(4, 12, 32), torch.randn(4, 9, 32),
                    tgt_mask=nn.Transformer.generate_square_subsequent_mask(12), tgt_is_causal=True,
                    memory_key_padding_mask=padding)
        return out.pow(2).mean()

    return _trainer(model, loss), model


def nonzero_rows_index_copy() -> Program:
    """Rows chosen by ``nonzero``, ``index_select`` and ``index_copy`` back, then ``masked_select``."""
    lin = nn.Linear(5, 5)

    def loss() -> torch.Tensor:
        x = torch.randn(60, 5)
        rows = torch.nonzero(x[:, 0] > 0).squeeze(1)
        y = lin(x)
        out = torch.zeros_like(y).index_copy(0, rows, y.index_select(0, rows) * 2)
        kept = torch.masked_select(out, out.abs() > 0.1)
        return kept.pow(2).mean() if kept.numel() else out.sum()

    return _trainer(lin, loss), lin


def sparse_embedding_sparse_adam() -> Program:
    """An ``nn.Embedding(sparse=True)`` trained by ``SparseAdam`` beside a dense head trained by ``Adam``."""
    embedding, head = nn.Embedding(100, 8, sparse=True), nn.Linear(8, 1)
    model = nn.ModuleList([embedding, head])
    sparse_opt = torch.optim.SparseAdam(embedding.parameters(), lr=1e-2)
    dense_opt = torch.optim.Adam(head.parameters(), lr=1e-2)

    def step() -> None:
        head(embedding(torch.randint(0, 100, (32, 5))).mean(1)).pow(2).mean().backward()
        sparse_opt.step()
        dense_opt.step()
        sparse_opt.zero_grad()
        dense_opt.zero_grad()

    return step, model


def attention_float_mask_weights() -> Program:
    """``nn.MultiheadAttention`` with a float ``-inf`` mask and its per-head weights returned."""
    attention = nn.MultiheadAttention(16, 4, batch_first=True, dropout=0.1)

    def loss() -> torch.Tensor:
        x = torch.randn(3, 10, 16)
        mask = torch.zeros(10, 10).masked_fill(torch.rand(10, 10) < 0.3, float("-inf"))
        mask.fill_diagonal_(0.0)
        out, weights = attention(x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=False)
        return out.pow(2).mean() + weights.mean()

    return _trainer(attention, loss), attention


def embedding_bag_max_last_offset() -> Program:
    """An ``EmbeddingBag`` in ``max`` mode with ``include_last_offset``, bags of random lengths."""
    bag = nn.EmbeddingBag(60, 8, mode="max", include_last_offset=True)

    def loss() -> torch.Tensor:
        lengths = torch.randint(1, 6, (10,))
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        return bag(torch.randint(0, 60, (int(lengths.sum()),)), offsets).pow(2).mean()

    return _trainer(bag, loss), bag


def conv3d_clip_classifier() -> Program:
    """Video clips through ``Conv3d``, ``BatchNorm3d`` and ``AdaptiveAvgPool3d``, trained by Adam."""
    model = nn.Sequential(nn.Conv3d(3, 6, 3, padding=1), nn.BatchNorm3d(6), nn.ReLU(), nn.AdaptiveAvgPool3d(1),
                          nn.Flatten(), nn.Linear(6, 5))

    def loss() -> torch.Tensor:
        return F.cross_entropy(model(torch.randn(2, 3, 4, 12, 12)), torch.randint(0, 5, (2,)))

    return _trainer(model, loss, torch.optim.Adam(model.parameters(), 1e-3)), model


def transposed_conv_group_norm() -> Program:
    """``ConvTranspose2d`` with ``output_padding``, ``GroupNorm``, ``PReLU``, a circular-padded conv,
    ``InstanceNorm2d`` and ``Mish``."""
    model = nn.Sequential(nn.ConvTranspose2d(4, 8, 3, stride=2, padding=1, output_padding=1), nn.GroupNorm(2, 8),
                          nn.PReLU(), nn.Conv2d(8, 4, 3, padding=1, padding_mode="circular"), nn.InstanceNorm2d(4),
                          nn.Mish())

    def loss() -> torch.Tensor:
        return F.smooth_l1_loss(model(torch.randn(2, 4, 7, 7)), torch.randn(2, 4, 14, 14))

    return _trainer(model, loss), model


def lbfgs_line_search() -> Program:
    """``LBFGS`` with a strong-Wolfe line search: the closure runs as often as the search asks."""
    model = nn.Linear(6, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, line_search_fn="strong_wolfe")
    x, y = torch.randn(40, 6), torch.randn(40, 1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    return (lambda: opt.step(closure)), model


def stft_istft_enhancer() -> Program:
    """Speech enhancement: ``stft``, ``view_as_real``, a conv, ``view_as_complex``, ``istft``."""
    conv = nn.Conv1d(2, 2, 3, padding=1)
    window = torch.hann_window(64)

    def loss() -> torch.Tensor:
        wave = torch.randn(2, 400)
        spec = torch.stft(wave, 64, hop_length=16, window=window, return_complex=True)
        enhanced = conv(torch.view_as_real(spec).permute(0, 3, 1, 2).flatten(2)).view(2, 2, 33, -1)
        back = torch.istft(torch.view_as_complex(enhanced.permute(0, 2, 3, 1).contiguous()), 64, hop_length=16,
                           window=window, length=400)
        return F.l1_loss(back, wave)

    return _trainer(conv, loss), conv


def regulariser_on_loss_item() -> Program:
    """A weight penalty added only when ``loss.item()`` is above 1: steps of two shapes."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

    def loss() -> torch.Tensor:
        value = F.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 1))
        if value.item() > 1.0:
            value = value + 1e-3 * sum(p.pow(2).sum() for p in model.parameters())
        return value

    return _trainer(model, loss), model


def accumulated_grid_index_put() -> Program:
    """Weights accumulated into a grid by ``index_put`` with two index tensors, then ``grid[torch.where(...)]``."""
    lin = nn.Linear(4, 4)

    def loss() -> torch.Tensor:
        rows, cols = torch.randint(0, 8, (50,)), torch.randint(0, 8, (50,))
        grid = torch.zeros(8, 8).index_put((rows, cols), lin(torch.randn(50, 4)).sum(1), accumulate=True)
        return grid.pow(2).mean() + 1e-2 * grid[torch.where(grid > 0)].sum()

    return _trainer(lin, loss), lin


def hashed_feature_crosses() -> Program:
    """Embedding ids made by hashing large raw ids (a multiply, a modulo, a ``bitwise_xor`` cross)."""
    embedding = nn.Embedding(97, 8)

    def loss() -> torch.Tensor:
        raw = torch.randint(0, 2**30, (32, 4))
        cross = torch.bitwise_xor(raw[:, 0], raw[:, 1]) % 97
        return (embedding((raw * 2654435761) % 97).sum(1) * embedding(cross)).sum(1).pow(2).mean()

    return _trainer(embedding, loss), embedding


def stacked_bidirectional_rnns() -> Program:
    """A two-layer bidirectional ReLU ``RNN`` with dropout, then an ``LSTM`` with ``proj_size``."""
    rnn = nn.RNN(5, 6, num_layers=2, nonlinearity="relu", bidirectional=True, dropout=0.2, batch_first=True)
    lstm = nn.LSTM(12, 8, proj_size=4, batch_first=True)
    model = nn.ModuleList([rnn, lstm])

    def loss() -> torch.Tensor:
        out, (_, c) = lstm(rnn(torch.randn(3, 9, 5))[0])
        return out.pow(2).mean() + c.abs().mean()

    return _trainer(model, loss), model


def sliding_windows_scans() -> Program:
    """``Tensor.unfold`` windows, ``diff``, ``flip``, ``rot90``, ``trapezoid``, ``logcumsumexp``, ``cumprod``."""
    lin = nn.Linear(5, 3)

    def loss() -> torch.Tensor:
        y = lin(torch.randn(4, 30).unfold(1, 5, 2))
        d = torch.diff(y, dim=1)
        turned = torch.rot90(y, 1, [1, 2])[:, :, :d.shape[1]].transpose(1, 2)
        return (torch.flip(d, [1]) * turned).mean() + torch.trapezoid(y.abs(), dim=1).mean() \
            + torch.logcumsumexp(y, 1).mean() + y.cumprod(1).mean()

    return _trainer(lin, loss), lin


def hessian_vector_penalty() -> Program:
    """A Hessian-vector product by double backward (``autograd.grad`` twice, ``create_graph``) as a penalty."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Softplus(), nn.Linear(6, 1))

    def loss() -> torch.Tensor:
        value = model(torch.randn(10, 6)).pow(2).mean()
        params = list(model.parameters())
        grads = torch.autograd.grad(value, params, create_graph=True)
        directions = [torch.randn_like(p) for p in params]
        products = torch.autograd.grad(sum((g * v).sum() for g, v in zip(grads, directions, strict=True)), params,
                                       create_graph=True)
        return value + 1e-3 * sum(h.pow(2).sum() for h in products)

    return _trainer(model, loss), model


def take_put_scatter_amax() -> Program:
    """Flat ``take`` and ``put_`` with ``accumulate``, ``scatter_reduce("amax")`` without the target's own values."""
    lin = nn.Linear(6, 6)

    def loss() -> torch.Tensor:
        y = lin(torch.randn(10, 6))
        flat = torch.randint(0, 60, (15,))
        taken = torch.take(y, flat)
        put = y.detach().clone().put_(flat, taken.detach(), accumulate=True)
        groups = torch.randint(0, 4, (10, 6))
        peaks = torch.zeros(4, 6).scatter_reduce(0, groups, y, reduce="amax", include_self=False)
        return taken.pow(2).mean() + peaks.mean() + 1e-3 * put.mean()

    return _trainer(lin, loss), lin


def contrastive_info_nce() -> Program:
    """InfoNCE over two noisy views: ``normalize``, a similarity matrix, ``cosine_similarity`` by broadcasting,
    ``pairwise_distance``."""
    encoder = nn.Sequential(nn.Linear(12, 16), nn.GELU(approximate="tanh"), nn.Linear(16, 8))

    def loss() -> torch.Tensor:
        a = torch.randn(24, 12)
        za, zb = F.normalize(encoder(a), dim=1), F.normalize(encoder(a + 0.1 * torch.randn(24, 12)), dim=1)
        similarity = F.cosine_similarity(za.unsqueeze(1), zb.unsqueeze(0), dim=-1)
        return F.cross_entropy(za @ zb.T / 0.1, torch.arange(24)) + F.pairwise_distance(za, zb).mean() \
            + similarity.diagonal().mean()

    return _trainer(encoder, loss), encoder


def truncated_bptt_hidden_state() -> Program:
    """A word-level LSTM language model whose hidden state is carried to the next batch, detached (truncated
    backpropagation through time, as PyTorch's word_language_model example trains)."""
    embedding, lstm, head = nn.Embedding(40, 16), nn.LSTM(16, 16, batch_first=True), nn.Linear(16, 40)
    model = nn.ModuleList([embedding, lstm, head])
    hidden: list[tuple[torch.Tensor, torch.Tensor] | None] = [None]

    def loss() -> torch.Tensor:
        tokens = torch.randint(0, 40, (4, 13))
        out, state = lstm(embedding(tokens[:, :-1]), hidden[0])
        hidden[0] = (state[0].detach(), state[1].detach())
        return F.cross_entropy(head(out).flatten(0, 1), tokens[:, 1:].flatten())

    return _trainer(model, loss), model


def adaptive_log_softmax_clusters() -> Program:
    """``nn.AdaptiveLogSoftmaxWithLoss`` over 200 classes in three clusters: each target's cluster found by a mask,
    its rows by ``nonzero``, its position within the cluster gathered."""
    proj = nn.Linear(16, 32)
    head = nn.AdaptiveLogSoftmaxWithLoss(32, 200, cutoffs=[20, 80], div_value=2.0)
    model = nn.ModuleList([proj, head])

    def loss() -> torch.Tensor:
        return head(proj(torch.randn(64, 16)), torch.randint(0, 200, (64,))).loss

    return _trainer(model, loss), model


def cluster_bias_index_select() -> Program:
    """A logit's bias and temperature per class within its cluster, looked up by ``index_select`` at each label's
    position in the cluster (the labels of one cluster found by a mask)."""
    lin = nn.Linear(16, 1)
    bias, temperature = nn.Parameter(torch.zeros(60)), nn.Parameter(torch.ones(60))
    model = nn.ParameterList([bias, temperature, lin.weight, lin.bias])

    def loss() -> torch.Tensor:
        labels = torch.randint(0, 100, (64,))
        keep = labels >= 40
        local = labels[keep] - 40
        logits = lin(torch.randn(64, 16))[keep].squeeze(1)
        logits = logits * temperature.index_select(0, local) + bias.index_select(0, local)
        return F.binary_cross_entropy_with_logits(logits, (local % 2).float())

    return _trainer(model, loss), model


def dirichlet_beta_mixture() -> Program:
    """Reparameterised ``Dirichlet`` and ``Beta`` samples (gamma sampling) and a ``MixtureSameFamily``'s log-density."""
    lin = nn.Linear(6, 8)

    def loss() -> torch.Tensor:
        h = F.softplus(lin(torch.randn(16, 6))) + 0.1
        dirichlet = torch.distributions.Dirichlet(h[:, :4])
        beta = torch.distributions.Beta(h[:, 4], h[:, 5])
        mixture = torch.distributions.MixtureSameFamily(torch.distributions.Categorical(logits=h[:, 6:8]),
                                                        torch.distributions.Normal(h[:, 6:8], torch.ones(16, 2)))
        return -(dirichlet.rsample().log().mean() + beta.rsample().mean() + mixture.log_prob(torch.randn(16)).mean())

    return _trainer(lin, loss), lin


def full_transformer_masks() -> Program:
    """``nn.Transformer`` (encoder and decoder) with a causal target mask and a padding mask drawn each step."""
    transformer = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32,
                                 batch_first=True, dropout=0.1)
    out = nn.Linear(16, 10)
    model = nn.ModuleList([transformer, out])

    def loss() -> torch.Tensor:
        pad = torch.rand(4, 7) < 0.2
        pad[:, 0] = False
        y = transformer(torch.randn(4, 7, 16), torch.randn(4, 5, 16),
                        tgt_mask=nn.Transformer.generate_square_subsequent_mask(5), src_key_padding_mask=pad,
                        memory_key_padding_mask=pad, tgt_is_causal=True)
        return F.cross_entropy(out(y).flatten(0, 1), torch.randint(0, 10, (20,)))

    return _trainer(model, loss), model


def lstm_cell_teacher_forcing() -> Program:
    """A decoder unrolled by hand with ``nn.LSTMCell``, fed the target or its own ``argmax`` by a coin per row."""
    embedding, cell, head = nn.Embedding(12, 8), nn.LSTMCell(8, 16), nn.Linear(16, 12)
    model = nn.ModuleList([embedding, cell, head])

    def loss() -> torch.Tensor:
        target = torch.randint(0, 12, (4, 6))
        h = c = torch.zeros(4, 16)
        token, total = target[:, 0], torch.zeros(())
        for t in range(1, 6):
            h, c = cell(embedding(token), (h, c))
            logits = head(h)
            total = total + F.cross_entropy(logits, target[:, t])
            token = torch.where(torch.rand(4) < 0.5, target[:, t], logits.argmax(-1))
        return total / 5

    return _trainer(model, loss), model


def unique_rows_with_counts() -> Program:
    """``torch.unique`` over rows (``dim=0``) with inverse indices and counts, each row weighted by its count."""
    lin = nn.Linear(3, 4)

    def loss() -> torch.Tensor:
        rows = torch.randint(0, 3, (40, 3)).float()
        unique, inverse, counts = torch.unique(rows, dim=0, return_inverse=True, return_counts=True)
        return (lin(unique)[inverse] / counts[inverse].unsqueeze(1)).pow(2).mean()

    return _trainer(lin, loss), lin


def index_reduce_mean() -> Program:
    """Rows pooled into random groups by ``index_reduce(..., "mean", include_self=False)``."""
    lin = nn.Linear(5, 5)

    def loss() -> torch.Tensor:
        pooled = torch.zeros(6, 5).index_reduce(0, torch.randint(0, 6, (30,)), lin(torch.randn(30, 5)), "mean",
                                                include_self=False)
        return pooled.pow(2).sum()

    return _trainer(lin, loss), lin


def private_generator_noise() -> Program:
    """Inputs and noise drawn from a ``torch.Generator`` of the program's own, not the global one."""
    lin = nn.Linear(8, 8)
    generator = torch.Generator().manual_seed(3)

    def loss() -> torch.Tensor:
        x = torch.randn(10, 8, generator=generator)
        return (lin(x + 0.1 * torch.rand(10, 8, generator=generator)) - x).pow(2).mean()

    return _trainer(lin, loss), lin


def randperm_mixup() -> Program:
    """Mixup: a batch blended with a ``randperm`` of itself by a ``Beta`` draw, both targets' losses weighted."""
    net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
    beta = torch.distributions.Beta(torch.tensor(0.4), torch.tensor(0.4))

    def loss() -> torch.Tensor:
        x, y = torch.randn(32, 10), torch.randint(0, 4, (32,))
        lam, perm = beta.sample(), torch.randperm(32)
        out = net(lam * x + (1 - lam) * x[perm])
        return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])

    return _trainer(net, loss), net


def cutmix_item_slices() -> Program:
    """CutMix: a box whose corners are read with ``tolist()``/``item()`` pasted from a permuted batch by slicing."""
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))

    def loss() -> torch.Tensor:
        x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 5, (8,))
        cx, cy = torch.randint(0, 16, (2,)).tolist()
        w = int(torch.randint(2, 8, ()).item())
        x1, x2, y1, y2 = max(cx - w, 0), min(cx + w, 16), max(cy - w, 0), min(cy + w, 16)
        perm = torch.randperm(8)
        x[:, :, y1:y2, x1:x2] = x[perm, :, y1:y2, x1:x2]
        lam = 1 - (x2 - x1) * (y2 - y1) / 256
        out = net(x)
        return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])

    return _trainer(net, loss), net


def gru_on_a_random_crop() -> Program:
    """A GRU over the first ``n`` steps of a sequence, ``n`` drawn each step and read with ``item()``."""
    gru = nn.GRU(4, 8, batch_first=True)

    def loss() -> torch.Tensor:
        n = int(torch.randint(3, 12, ()).item())
        out, _ = gru(torch.randn(6, 12, 4)[:, :n])
        return out[:, -1].pow(2).mean()

    return _trainer(gru, loss), gru


def fake_quant_aware_training() -> Program:
    """Quantisation-aware training: per-channel fake-quantised weights, a learnable per-tensor scale and zero point."""
    model = nn.Module()
    model.lin = nn.Linear(8, 8)
    model.scale, model.zero_point = nn.Parameter(torch.tensor([0.05])), nn.Parameter(torch.tensor([0.0]))

    def loss() -> torch.Tensor:
        w = torch.fake_quantize_per_channel_affine(model.lin.weight, torch.full((8,), 0.02),
                                                   torch.zeros(8, dtype=torch.int32), 0, -128, 127)
        x = torch._fake_quantize_learnable_per_tensor_affine(torch.randn(5, 8), model.scale, model.zero_point, 0, 255,
                                                             1.0)
        return F.linear(x, w, model.lin.bias).pow(2).mean()

    return _trainer(model, loss), model


def several_optimisers() -> Program:
    """One model, five optimisers over its parts: ``Rprop``, ``NAdam``, ``Adagrad``, centred ``RMSprop`` with
    momentum, ``AdamW`` with ``amsgrad``."""
    layers = [nn.Linear(6, 6) for _ in range(4)] + [nn.Linear(6, 2)]
    model = nn.Sequential(*layers)
    opts = [torch.optim.Rprop(layers[0].parameters(), lr=1e-3), torch.optim.NAdam(layers[1].parameters(), lr=1e-3),
            torch.optim.Adagrad(layers[2].parameters()),
            torch.optim.RMSprop(layers[3].parameters(), momentum=0.9, centered=True),
            torch.optim.AdamW(layers[4].parameters(), amsgrad=True)]

    def step() -> None:
        model(torch.randn(8, 6)).pow(2).mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()

    return step, model


def plateau_scheduler_on_item() -> Program:
    """Gradients clipped by value, ``ReduceLROnPlateau`` stepped on ``loss.item()``."""
    lin = nn.Linear(4, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1)

    def step() -> None:
        value = (lin(torch.randn(16, 4)) - 1).pow(2).mean()
        value.backward()
        torch.nn.utils.clip_grad_value_(lin.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        scheduler.step(value.item())

    return step, lin


def dead_units_reinitialised() -> Program:
    """Hidden units that fired on under 30 % of the batch get fresh weights, chosen by a boolean mask, after the
    step; the optimiser made anew each step."""
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def step() -> None:
        h = net[1](net[0](torch.randn(32, 8)))
        net[2](h).pow(2).mean().backward()
        torch.optim.SGD(net.parameters(), lr=1e-2).step()
        net.zero_grad()
        with torch.no_grad():
            dead = (h > 0).float().mean(0) < 0.3
            net[0].weight[dead] = torch.randn(int(dead.sum()), 8) * 0.1
            net[0].bias[dead] = 0.1

    return step, net


def svdvals_lstsq_slogdet_expm() -> Program:
    """Batched ``svdvals``, ``lstsq``, ``slogdet`` and ``matrix_exp``, all differentiated."""
    lin = nn.Linear(4, 4)

    def loss() -> torch.Tensor:
        m = lin(torch.randn(3, 4, 4)) + 3 * torch.eye(4)
        solution = torch.linalg.lstsq(m, torch.randn(3, 4, 2)).solution
        _, logdet = torch.linalg.slogdet(m @ m.mT + torch.eye(4))
        return (torch.linalg.svdvals(m) - 3).pow(2).mean() + 1e-2 * solution.pow(2).mean() + 1e-2 * logdet.mean() \
            + torch.linalg.matrix_exp(0.1 * m).mean()

    return _trainer(lin, loss), lin


def complex_polar_view_as_real() -> Program:
    """Complex tensors made by ``torch.polar`` and ``view_as_complex``, read back by ``view_as_real`` and ``angle``
    (their backward multiplies by complex scalars)."""
    lin = nn.Linear(8, 8)

    def loss() -> torch.Tensor:
        x = lin(torch.randn(4, 8))
        z = torch.polar(x.abs() + 1e-3, x) * torch.view_as_complex(torch.randn(4, 8, 2))
        return torch.view_as_real(z).pow(2).mean() + z.angle().mean()

    return _trainer(lin, loss), lin


def nan_masked_regression() -> Program:
    """Targets with missing values (NaN) left out of the loss by an ``isfinite`` mask and ``nan_to_num``."""
    lin = nn.Linear(6, 6)

    def loss() -> torch.Tensor:
        target = torch.randn(20, 6)
        target[torch.rand(20, 6) < 0.3] = float("nan")
        ok = torch.isfinite(target)
        diff = (lin(torch.randn(20, 6)) - torch.nan_to_num(target)) * ok
        return diff.pow(2).sum() / ok.sum().clamp(min=1)

    return _trainer(lin, loss), lin


def float64_dropout_variants() -> Program:
    """A float64 network with ``Dropout2d`` and ``AlphaDropout``."""
    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Dropout2d(0.2), nn.Flatten(), nn.AlphaDropout(0.1),
                        nn.Linear(4 * 6 * 6, 3)).double()

    def loss() -> torch.Tensor:
        return F.cross_entropy(net(torch.randn(5, 2, 8, 8, dtype=torch.float64)), torch.randint(0, 3, (5,)))

    return _trainer(net, loss), net


def losses_medley() -> Program:
    """Huber, KL divergence between log-probabilities, Poisson NLL, multi-label soft margin, cosine embedding and
    margin ranking losses, summed."""
    lin = nn.Linear(6, 6)

    def loss() -> torch.Tensor:
        y, t = lin(torch.randn(10, 6)), torch.randn(10, 6)
        return (F.huber_loss(y, t)
                + F.kl_div(F.log_softmax(y, 1), F.log_softmax(t, 1), log_target=True, reduction="batchmean")
                + F.poisson_nll_loss(y, t.abs()) + F.multilabel_soft_margin_loss(y, (t > 0).float())
                + F.cosine_embedding_loss(y, t, torch.randint(0, 2, (10,)) * 2 - 1)
                + F.margin_ranking_loss(y[:, 0], y[:, 1], torch.sign(t[:, 0])))

    return _trainer(lin, loss), lin


def bilinear_unshuffle_channel_shuffle() -> Program:
    """``nn.Bilinear``, ``pixel_unshuffle`` and ``channel_shuffle``."""
    bilinear, conv = nn.Bilinear(4, 4, 3), nn.Conv2d(16, 8, 1)
    model = nn.ModuleList([bilinear, conv])

    def loss() -> torch.Tensor:
        y = F.channel_shuffle(conv(F.pixel_unshuffle(torch.randn(2, 4, 8, 8), 2)), 2)
        return bilinear(torch.randn(6, 4), torch.randn(6, 4)).sum() + y.pow(2).mean()

    return _trainer(model, loss), model


def cdist_l1_and_pdist() -> Program:
    """``cdist`` with ``p=1`` and ``pdist``, differentiated."""
    lin = nn.Linear(5, 5)

    def loss() -> torch.Tensor:
        x = lin(torch.randn(12, 5))
        return torch.cdist(x, torch.randn(7, 5), p=1).mean() + torch.pdist(x).mean()

    return _trainer(lin, loss), lin


def foreach_momentum_by_hand() -> Program:
    """An optimiser written by hand with ``_foreach_`` ops: momentum, the gradients' norms, a step scaled by the
    largest read with ``float()``."""
    net = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    params = list(net.parameters())
    buffers = [torch.zeros_like(p) for p in params]

    def step() -> None:
        net(torch.randn(8, 6)).pow(2).mean().backward()
        grads = [p.grad for p in params]
        with torch.no_grad():
            torch._foreach_mul_(buffers, 0.9)
            torch._foreach_add_(buffers, grads)
            scale = 1.0 / max(1.0, float(torch.stack(torch._foreach_norm(grads)).max()))
            torch._foreach_add_(params, buffers, alpha=-1e-2 * scale)
        for p in params:
            p.grad = None

    return step, net


def functional_call_symmetrised() -> Program:
    """``torch.func.functional_call`` with a weight made symmetric each step in place of the module's own."""
    net = nn.Linear(6, 6)

    def loss() -> torch.Tensor:
        weights = {"weight": 0.5 * (net.weight + net.weight.T), "bias": net.bias}
        return torch.func.functional_call(net, weights, (torch.randn(4, 6),)).pow(2).mean()

    return _trainer(net, loss), net


def dqn_target_network() -> Program:
    """Double DQN: the online network's ``argmax`` picks the next action, a Polyak-averaged target network values
    it under ``no_grad``, the taken actions' values ``gather``-ed; episodes ending at random."""
    q = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    target = copy.deepcopy(q)
    opt = torch.optim.Adam(q.parameters(), lr=1e-3)

    def step() -> None:
        s, a, r, s2 = torch.randn(32, 8), torch.randint(0, 4, (32,)), torch.randn(32), torch.randn(32, 8)
        done = torch.rand(32) < 0.1
        with torch.no_grad():
            y = r + 0.99 * target(s2).gather(1, q(s2).argmax(1, keepdim=True)).squeeze(1) * (~done)
        opt.zero_grad()
        F.smooth_l1_loss(q(s).gather(1, a.unsqueeze(1)).squeeze(1), y).backward()
        opt.step()
        with torch.no_grad():
            for p, t in zip(q.parameters(), target.parameters(), strict=True):
                t.mul_(0.995).add_(p, alpha=0.005)

    return step, nn.ModuleList([q, target])


def ppo_minibatch_epochs() -> Program:
    """PPO: old log-probabilities under ``no_grad``, normalised advantages, two epochs over ``randperm`` minibatches
    with the clipped ratio and an entropy bonus, gradients clipped by norm: four optimiser steps a step."""
    pi = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.Adam(pi.parameters(), lr=1e-3)

    def step() -> None:
        obs, act, adv = torch.randn(64, 6), torch.randint(0, 3, (64,)), torch.randn(64)
        with torch.no_grad():
            old = torch.distributions.Categorical(logits=pi(obs)).log_prob(act)
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        for _ in range(2):
            for idx in torch.randperm(64).split(16):
                dist = torch.distributions.Categorical(logits=pi(obs[idx]))
                ratio = (dist.log_prob(act[idx]) - old[idx]).exp()
                clipped = torch.min(ratio * adv[idx], ratio.clamp(0.8, 1.2) * adv[idx])
                opt.zero_grad()
                (-clipped.mean() - 0.01 * dist.entropy().mean()).backward()
                nn.utils.clip_grad_norm_(pi.parameters(), 0.5)
                opt.step()

    return step, pi


def sac_tanh_gaussian() -> Program:
    """A soft actor-critic policy: a Normal squashed by a ``TanhTransform`` in a ``TransformedDistribution``."""
    net = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 4))

    def loss() -> torch.Tensor:
        mu, log_std = net(torch.randn(32, 5)).chunk(2, -1)
        dist = torch.distributions.TransformedDistribution(torch.distributions.Normal(mu, log_std.clamp(-5, 2).exp()),
                                                           [torch.distributions.TanhTransform(cache_size=1)])
        a = dist.rsample()
        return (0.2 * dist.log_prob(a).sum(-1) - a.pow(2).sum(-1)).mean()

    return _trainer(net, loss), net


def grad_hooks_and_retain_graph() -> Program:
    """Tensor hooks that clamp and scale gradients, two backward passes over one graph (``retain_graph``)."""
    lin1, lin2 = nn.Linear(6, 6), nn.Linear(6, 1)
    model = nn.ModuleList([lin1, lin2])
    lin1.weight.register_hook(lambda g: g.clamp(-0.1, 0.1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def step() -> None:
        h = torch.tanh(lin1(torch.randn(8, 6)))
        h.register_hook(lambda g: g * 0.5)
        out = lin2(h)
        out.pow(2).mean().backward(retain_graph=True)
        out.abs().mean().backward()
        opt.step()
        opt.zero_grad()

    return step, model


def module_hooks() -> Program:
    """A full backward hook that keeps each gradient's norm, a forward hook that replaces a module's output."""
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    norms: list[torch.Tensor] = []
    net[0].register_full_backward_hook(lambda _m, _gi, go: norms.append(go[0].norm()))
    net[2].register_forward_hook(lambda _m, _i, out: out * 2)

    def loss() -> torch.Tensor:
        del norms[:-10]
        return net(torch.randn(7, 6)).pow(2).mean()

    return _trainer(net, loss), net


def packed_bilstm_unsorted() -> Program:
    """A bidirectional LSTM over sequences packed unsorted (``enforce_sorted=False``), padded back to a fixed
    ``total_length``."""
    lstm = nn.LSTM(4, 6, batch_first=True, bidirectional=True)

    def loss() -> torch.Tensor:
        lengths = torch.randint(1, 10, (5,))
        packed = pack_padded_sequence(torch.randn(5, 10, 4), lengths, batch_first=True, enforce_sorted=False)
        out, _ = pad_packed_sequence(lstm(packed)[0], batch_first=True, total_length=10)
        return out.pow(2).sum() / lengths.sum()

    return _trainer(lstm, loss), lstm


def sdpa_grouped_query() -> Program:
    """Grouped-query attention: four query heads over two key/value heads, ``enable_gqa`` with a causal mask."""
    q_proj, kv_proj = nn.Linear(16, 16), nn.Linear(16, 16)
    model = nn.ModuleList([q_proj, kv_proj])

    def loss() -> torch.Tensor:
        x = torch.randn(2, 6, 16)
        q = q_proj(x).view(2, 6, 4, 4).transpose(1, 2)
        k, v = kv_proj(x).view(2, 6, 2, 8).transpose(1, 2).chunk(2, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).pow(2).mean()

    return _trainer(model, loss), model


def tril_indices_pairwise() -> Program:
    """Pairwise dot products of embeddings, the lower triangle taken by ``tril_indices`` (DLRM's interaction)."""
    embedding = nn.Embedding(50, 8)

    def loss() -> torch.Tensor:
        e = embedding(torch.randint(0, 50, (16, 5)))
        rows, cols = torch.tril_indices(5, 5, offset=-1)
        return torch.bmm(e, e.transpose(1, 2))[:, rows, cols].pow(2).mean()

    return _trainer(embedding, loss), embedding


def argwhere_and_where() -> Program:
    """Elements picked by ``argwhere`` and by one-argument ``torch.where``, read by advanced indexing."""
    lin = nn.Linear(4, 4)

    def loss() -> torch.Tensor:
        y = lin(torch.randn(20, 4))
        picked = torch.argwhere(y > 0.5)
        rows, cols = torch.where(y < -0.5)
        return y[picked[:, 0], picked[:, 1]].sum() - y[rows, cols].sum()

    return _trainer(lin, loss), lin


def parameters_as_one_vector() -> Program:
    """A normalised gradient step on all parameters at once, through ``parameters_to_vector`` and back."""
    net = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 1))

    def step() -> None:
        net(torch.randn(10, 5)).pow(2).mean().backward()
        with torch.no_grad():
            flat = nn.utils.parameters_to_vector(net.parameters())
            grad = torch.cat([p.grad.flatten() for p in net.parameters()])
            nn.utils.vector_to_parameters(flat - 1e-2 * grad / (grad.norm() + 1e-6), net.parameters())
        net.zero_grad()

    return step, net


def gaussian_nll_and_triplet_distance() -> Program:
    """A Gaussian NLL with a predicted variance, a triplet loss with a cosine distance given as a function."""
    lin = nn.Linear(6, 8)

    def loss() -> torch.Tensor:
        out = lin(torch.randn(12, 6))
        return F.gaussian_nll_loss(out[:, :4], torch.randn(12, 4), F.softplus(out[:, 4:]) + 1e-3) \
            + F.triplet_margin_with_distance_loss(out[:4], out[4:8], out[8:],
                                                  distance_function=lambda x, y: 1 - F.cosine_similarity(x, y))

    return _trainer(lin, loss), lin


def attention_other_key_value_widths() -> Program:
    """``nn.MultiheadAttention`` whose keys and values have widths of their own (``kdim``, ``vdim``), no weights
    returned."""
    mha = nn.MultiheadAttention(8, 2, kdim=6, vdim=5, batch_first=True)

    def loss() -> torch.Tensor:
        out, _ = mha(torch.randn(3, 4, 8), torch.randn(3, 7, 6), torch.randn(3, 7, 5), need_weights=False)
        return out.pow(2).mean()

    return _trainer(mha, loss), mha


def wgan_weight_clipping() -> Program:
    """The original WGAN critic: RMSprop, then every parameter clamped in place through ``.data``."""
    critic = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt = torch.optim.RMSprop(critic.parameters(), lr=5e-5)

    def step() -> None:
        (critic(torch.randn(16, 4) + 1).mean() - critic(torch.randn(16, 4)).mean()).backward()
        opt.step()
        opt.zero_grad()
        for p in critic.parameters():
            p.data.clamp_(-0.01, 0.01)

    return step, critic


def volumetric_grid_sample() -> Program:
    """``grid_sample`` over a 3-D volume at random points, an antialiased downsampling, a ``diagonal`` read."""
    conv = nn.Conv3d(1, 2, 3, padding=1)

    def loss() -> torch.Tensor:
        v = conv(torch.randn(2, 1, 6, 8, 8))
        sampled = F.grid_sample(v, torch.rand(2, 4, 4, 4, 3) * 2 - 1, align_corners=False)
        small = F.interpolate(v.flatten(1, 2), scale_factor=0.5, mode="bilinear", antialias=True)
        return sampled.pow(2).mean() + small.mean() + v.diagonal(dim1=-2, dim2=-1).mean()

    return _trainer(conv, loss), conv


def embedding_grad_by_frequency_and_mean_bag() -> Program:
    """An embedding whose gradient is scaled by each id's frequency in the batch, and a mean-mode ``EmbeddingBag``
    over bags of random lengths (offsets from a ``cumsum``)."""
    embedding, bag = nn.Embedding(30, 6, scale_grad_by_freq=True), nn.EmbeddingBag(30, 6, mode="mean")
    model = nn.ModuleList([embedding, bag])

    def loss() -> torch.Tensor:
        lengths = torch.randint(1, 5, (8,))
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        pooled = bag(torch.randint(0, 30, (int(lengths.sum()),)), offsets)
        return embedding(torch.randint(0, 30, (8, 3))).sum(1).mul(pooled).mean()

    return _trainer(model, loss), model


def compiled_mlp() -> Program:
    """A model wrapped in ``torch.compile`` (Inductor, C++ on the CPU) and trained through the compiled module."""
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    compiled = torch.compile(net)

    def loss() -> torch.Tensor:
        return compiled(torch.randn(32, 8)).pow(2).mean()

    return _trainer(net, loss), net


def capacity_moe_dispatch() -> Program:
    """Switch/GShard-style experts with a capacity: each token's place within its expert from a ``cumsum`` over
    one-hot routing, tokens past the capacity dropped, dispatch and combine by ``einsum`` over a dense
    [tokens, experts, capacity] tensor, and the load-balancing loss."""
    experts, d, capacity = 4, 16, 10
    router = nn.Linear(d, experts)
    w1 = nn.Parameter(torch.randn(experts, d, 32) * 0.1)
    w2 = nn.Parameter(torch.randn(experts, 32, d) * 0.1)
    model = nn.ModuleList([router])
    model.w1, model.w2 = w1, w2

    def loss() -> torch.Tensor:
        x = torch.randn(48, d)
        probs = router(x).softmax(-1)
        gate, expert = probs.max(-1)
        onehot = F.one_hot(expert, experts)
        position = (onehot.cumsum(0) - 1) * onehot
        keep = (position < capacity) & onehot.bool()
        dispatch = F.one_hot(position.clamp(max=capacity - 1), capacity) * keep.unsqueeze(-1)
        dispatch = dispatch.float()
        routed = torch.einsum("tec,td->ecd", dispatch, x)
        out = torch.einsum("ecf,efd->ecd", F.gelu(torch.einsum("ecd,edf->ecf", routed, w1)), w2)
        combined = torch.einsum("tec,ecd->td", dispatch * gate[:, None, None], out)
        balance = experts * (onehot.float().mean(0) * probs.mean(0)).sum()
        return (combined - x).pow(2).mean() + 0.01 * balance

    return _trainer(model, loss), model


def scheduled_sampling_decoder() -> Program:
    """A GRU decoder trained with scheduled sampling: at each step, with some probability, the next input is the
    model's own ``argmax`` prediction looked up in the embedding instead of the target token."""
    vocab, d = 30, 16
    emb, cell, head = nn.Embedding(vocab, d), nn.GRUCell(d, d), nn.Linear(d, vocab)
    model = nn.ModuleList([emb, cell, head])

    def loss() -> torch.Tensor:
        targets = torch.randint(1, vocab, (6, 8))
        h = torch.zeros(6, d)
        token = torch.zeros(6, dtype=torch.long)
        total = torch.zeros(())
        for t in range(8):
            h = cell(emb(token), h)
            logits = head(h)
            total = total + F.cross_entropy(logits, targets[:, t])
            own = logits.argmax(-1)
            use_own = torch.rand(6) < 0.3
            token = torch.where(use_own, own, targets[:, t])
        return total / 8

    return _trainer(model, loss), model


def mae_random_masking() -> Program:
    """MAE-style random masking: patches shuffled by ``argsort`` of noise, the kept ones ``gather``ed, an encoder
    over them, mask tokens appended and unshuffled by ``gather`` with the inverse permutation, loss on the masked
    patches only."""
    n, length, d, keep = 4, 16, 24, 5
    enc = nn.TransformerEncoderLayer(d, 2, 48, dropout=0.0, batch_first=True)
    dec, mask_token = nn.Linear(d, d), nn.Parameter(torch.zeros(1, 1, d))
    model = nn.ModuleList([enc, dec])
    model.mask_token = mask_token

    def loss() -> torch.Tensor:
        x = torch.randn(n, length, d)
        ids_shuffle = torch.argsort(torch.rand(n, length), dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :keep]
        kept = torch.gather(x, 1, ids_keep.unsqueeze(-1).repeat(1, 1, d))
        latent = enc(kept)
        full = torch.cat([latent, mask_token.repeat(n, length - keep, 1)], dim=1)
        full = torch.gather(full, 1, ids_restore.unsqueeze(-1).repeat(1, 1, d))
        mask = torch.ones(n, length)
        mask[:, :keep] = 0
        mask = torch.gather(mask, 1, ids_restore)
        per_patch = (dec(full) - x).pow(2).mean(-1)
        return (per_patch * mask).sum() / mask.sum()

    return _trainer(model, loss), model


PROGRAMS = {f.__name__: f for f in (
    fno_spectral, checkpointed_mlp, grad_accumulation, vae_reparameterised, policy_gradient,
    normal_kl_categorical_actions, multinomial_from_kept_probabilities, gaussian_process_cholesky, sdpa_causal_dropout,
    spectral_and_weight_norm, channels_last_fused_adam, transformer_encoder_padding, searchsorted_sampling,
    embedding_max_norm,
    ctc_bidirectional_lstm, fp16_autocast_grad_scaler, one_hot_width_from_labels, wgan_gradient_penalty,
    custom_autograd_function, ema_of_the_weights, gumbel_hard_routing, triplet_hard_mining,
    focal_loss_label_smoothing, bucketized_feature, packed_gru, maxpool_unpool_autoencoder, spatial_transformer,
    scatter_reduce_graph_pool, clip_grad_onecycle, bf16_autocast_cpu, unfold_patches_roll, cummax_kthvalue_sort,
    embedding_bag_weighted_padding, pad_sequence_sdpa_mask, eigh_whitening, interpolate_pixel_shuffle,
    vq_codebook_straight_through, ragged_split_by_lengths, segment_means_by_unique, masked_scatter_index_fill,
    pruned_and_orthogonal, positions_from_attention_mask, sort_by_length_and_back, sparse_adjacency_gcn,
    topk_take_along_quantile, batched_solve_and_qr, transformer_decoder_causal, nonzero_rows_index_copy,
    sparse_embedding_sparse_adam, attention_float_mask_weights, embedding_bag_max_last_offset, conv3d_clip_classifier,
    transposed_conv_group_norm, lbfgs_line_search, stft_istft_enhancer, regulariser_on_loss_item,
    accumulated_grid_index_put, hashed_feature_crosses, stacked_bidirectional_rnns, sliding_windows_scans,
    hessian_vector_penalty, take_put_scatter_amax, contrastive_info_nce,
    truncated_bptt_hidden_state,
    adaptive_log_softmax_clusters, cluster_bias_index_select, dirichlet_beta_mixture, full_transformer_masks,
    lstm_cell_teacher_forcing,
    unique_rows_with_counts, index_reduce_mean, private_generator_noise, randperm_mixup, cutmix_item_slices,
    gru_on_a_random_crop, fake_quant_aware_training, several_optimisers, plateau_scheduler_on_item,
    dead_units_reinitialised, svdvals_lstsq_slogdet_expm, complex_polar_view_as_real, nan_masked_regression,
    float64_dropout_variants, losses_medley, bilinear_unshuffle_channel_shuffle, cdist_l1_and_pdist,
    foreach_momentum_by_hand, functional_call_symmetrised,
    dqn_target_network, ppo_minibatch_epochs, sac_tanh_gaussian, grad_hooks_and_retain_graph, module_hooks,
    packed_bilstm_unsorted, sdpa_grouped_query, tril_indices_pairwise, argwhere_and_where, parameters_as_one_vector,
    gaussian_nll_and_triplet_distance, attention_other_key_value_widths, wgan_weight_clipping, volumetric_grid_sample,
    embedding_grad_by_frequency_and_mean_bag, compiled_mlp, capacity_moe_dispatch, scheduled_sampling_decoder,
    mae_random_masking)}
