"""Llama 4's mixture-of-experts feed-forward: a router, grouped routed experts and a shared expert.

Shape suffixes as in :mod:`workloads.llama.model`, plus ``t`` tokens (batch x sequence flattened),
``k`` experts per token, ``n`` routed token copies (``t * k``), ``x`` experts, ``f`` an expert's
hidden dim.

Routing is token-choice and dropless: every token goes to its ``top_k`` experts, however uneven the
load, so no token is ever dropped (``tokens_dropped`` is 0 by construction). The routed copies are
sorted by expert so each expert's tokens are one contiguous slice, and the experts run as one
grouped GEMM (``torch.nn.functional.grouped_mm``, see :func:`grouped_mm`) over those slices: the work is proportional to
the tokens routed, not to ``tokens x experts`` as in transformers' dense ``Llama4TextMoe``.

Load balancing follows DeepSeek-V3's auxiliary-loss-free scheme (as torchtitan does): a per-expert
bias is added to the scores for *selection only*; between optimiser steps
:func:`update_expert_bias` nudges it by ``coeff * sign(mean_load - load)`` and re-centres it, so
overloaded experts become less likely to be picked. The gate values that scale the tokens always
come from the raw scores. An optional switch-style auxiliary loss is available too.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from workloads.llama.args import ROUTER_SCORE_FUNCTIONS

# torch.nn.functional.grouped_mm is public from torch 2.10 (its op, torch._grouped_mm, runs on the CPU and in
# float32 from 2.9; in 2.8 only on CUDA sm90 in bf16). Where this torch lacks it, grouped_mm_loop stands in.
# On CUDA the fused kernel needs sm90+ (Hopper, Blackwell) and bf16 inputs (bf16 autocast: workload.dtype
# auto or bfloat16); other GPUs and dtypes run torch's own per-group fallback, which reads the offsets on
# the host (one device-to-host wait per call). Every row stride must be a multiple of 16 bytes (ModelArgs
# checks dim and moe_hidden_dim are multiples of 8).
_GROUPED_MM = getattr(F, "grouped_mm", None)


def local_tensor(weight: torch.Tensor) -> torch.Tensor:
    """What this process multiplies by: ``weight`` itself, or, where it is a DTensor (a mixture of experts on
    a device mesh, :mod:`workloads.llama.expert_mesh`), its local shard. The shard's gradient is declared
    ``Partial`` on every mesh dim the weight is replicated on: the ranks holding copies each add their own
    part (other tokens, or a tensor-parallel rank's share of the experts' width), and the sum is the
    gradient; the mesh code reduces it to the parameter's placement after the backward."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before its module is imported
    if dtensor is None or not isinstance(weight, dtensor.DTensor):
        return weight
    grad_placements = [dtensor.Partial() if p.is_replicate() else p for p in weight.placements]
    return weight.to_local(grad_placements=grad_placements)


def grouped_mm_loop(x_nd: torch.Tensor, w_xdf: torch.Tensor, offsets_x: torch.Tensor) -> torch.Tensor:
    """What ``F.grouped_mm(x_nd, w_xdf, offs=offsets_x)`` computes, one matmul per group: rows
    ``offsets[i-1]:offsets[i]`` of ``x_nd`` times ``w_xdf[i]``. Reads the offsets on the host."""
    ends = offsets_x.tolist()
    sizes = [end - start for start, end in zip([0, *ends[:-1]], ends, strict=True)]
    parts = [x_md @ w_df for x_md, w_df in zip(x_nd[: sum(sizes)].split(sizes), w_xdf.unbind(0), strict=True)]
    return torch.cat(parts) if parts else x_nd.new_empty(0, w_xdf.shape[-1])


def grouped_mm(x_nd: torch.Tensor, w_xdf: torch.Tensor, offsets_x: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM of consecutive row slices by per-group weights: torch's where it has one, else a loop."""
    if _GROUPED_MM is not None:
        return _GROUPED_MM(x_nd, w_xdf, offs=offsets_x)
    return grouped_mm_loop(x_nd, w_xdf, offsets_x)


def _run_experts(x_nd: torch.Tensor, tokens_per_expert_x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                 w2: torch.Tensor) -> torch.Tensor:
    """Every expert's SwiGLU on its slice of ``x_nd``: three grouped GEMMs."""
    if torch.is_autocast_enabled(x_nd.device.type):  # grouped_mm has no autocast rule
        dtype = torch.get_autocast_dtype(x_nd.device.type)
        x_nd, w1, w3, w2 = x_nd.to(dtype), w1.to(dtype), w3.to(dtype), w2.to(dtype)
    offsets_x = tokens_per_expert_x.cumsum(0).to(torch.int32)
    gate_nf, up_nf = grouped_mm(x_nd, w1, offsets_x), grouped_mm(x_nd, w3, offsets_x)
    out_nd = grouped_mm(F.silu(gate_nf) * up_nf, w2, offsets_x)
    if out_nd.requires_grad:
        # grouped_mm's backward rejects a stride-0 gradient (what `out.sum()` sends back)
        out_nd.register_hook(torch.Tensor.contiguous)
    return out_nd


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts stored as stacked weights: ``w1 [x, d, f]`` (gate), ``w3 [x, d, f]`` (up)
    and ``w2 [x, f, d]`` (down). Transformers fuses gate and up into one ``gate_up_proj [x, d, 2f]``
    (:mod:`workloads.llama.hf` splits it on load); kept apart here, each splits over tensor-parallel ranks
    along ``f`` like the dense feed-forward's ``w1``/``w3``."""

    def __init__(self, n_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        # torch.compile leaves the grouped GEMMs out (a graph break): grouped_mm's fake-tensor rule in torch 2.13
        # accepts only bfloat16, so a float32 model would not trace; eager grouped_mm runs both. Wrapped here,
        # not with a decorator: torch.compiler.disable imports torch._dynamo (seconds of CPU), which a process
        # that builds no mixture of experts never needs
        self._eager_experts = torch.compiler.disable(_run_experts)

    def forward(self, x_nd: torch.Tensor, tokens_per_expert_x: torch.Tensor) -> torch.Tensor:
        """``x_nd`` holds each expert's tokens as consecutive slices of the given sizes (this process's
        experts: all of them, or its shard under expert parallelism)."""
        return self._eager_experts(x_nd, tokens_per_expert_x, local_tensor(self.w1), local_tensor(self.w3),
                                   local_tensor(self.w2))

    @torch.no_grad()
    def init_weights(self, init_std: float, out_std: float, generator: torch.Generator | None) -> None:
        if generator is None:  # initialised where each shard lives (DTensors): drawn one by one
            _trunc_normal(self.w1, init_std, generator)
            _trunc_normal(self.w3, init_std, generator)
        else:  # drawn as one [x, d, 2f] tensor, gate columns first (transformers' layout): a seed's weights stay put
            gate_up = torch.empty(*self.w1.shape[:-1], 2 * self.w1.shape[-1], device=self.w1.device,
                                  dtype=self.w1.dtype)
            _trunc_normal(gate_up, init_std, generator)
            gate, up = gate_up.chunk(2, dim=-1)
            self.w1.copy_(gate)
            self.w3.copy_(up)
        _trunc_normal(self.w2, out_std, generator)


class SharedExpert(nn.Module):
    """The dense SwiGLU expert every token also passes through (transformers' names)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x_td: torch.Tensor) -> torch.Tensor:
        gate, up, down = (local_tensor(linear.weight) for linear in (self.gate_proj, self.up_proj, self.down_proj))
        return F.linear(F.silu(F.linear(x_td, gate)) * F.linear(x_td, up), down)

    def init_weights(self, init_std: float, out_std: float, generator: torch.Generator | None) -> None:
        _trunc_normal(self.gate_proj.weight, init_std, generator)
        _trunc_normal(self.up_proj.weight, init_std, generator)
        _trunc_normal(self.down_proj.weight, out_std, generator)


class MoE(nn.Module):
    """Router + grouped routed experts + shared expert: ``shared(x) + sum_k expert_k(g_k * x)``.

    As in Llama 4 (and transformers' ``Llama4TextMoe``) the gate value ``g_k`` scales the token
    *before* its expert, not the expert's output. ``tokens_per_expert`` counts, while training,
    the routed copies each expert received since the last :func:`update_expert_bias`; it feeds
    the bias update and the load metrics.
    """

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int,
                 score_function: str = "sigmoid", shared_expert: bool = True) -> None:
        super().__init__()
        if score_function not in ROUTER_SCORE_FUNCTIONS:
            raise ValueError(f"router score function {score_function!r}; allowed: {ROUTER_SCORE_FUNCTIONS}")
        self.n_experts, self.top_k, self.score_function = n_experts, top_k, score_function
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, dim, hidden_dim)
        self.shared_expert = SharedExpert(dim, hidden_dim) if shared_expert else None
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts, dtype=torch.float32), persistent=False)
        self.aux_loss: torch.Tensor | None = None  # set by forward when training; see aux_loss_weight
        self.aux_loss_weight = 0.0
        self.dispatcher: ExpertDispatcher = LocalDispatcher()

    def route(self, x_td: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k experts per token, their gate values, and the float32 scores of every expert."""
        scores_tx = F.linear(x_td, local_tensor(self.router.weight)).float()
        scores_tx = scores_tx.sigmoid() if self.score_function == "sigmoid" else scores_tx.softmax(dim=-1)
        _, experts_tk = torch.topk(scores_tx + self.expert_bias, self.top_k, dim=-1)
        return experts_tk, scores_tx.gather(-1, experts_tk), scores_tx

    def forward(self, x_bsd: torch.Tensor) -> torch.Tensor:
        x_td = x_bsd.reshape(-1, x_bsd.shape[-1])
        experts_tk, gates_tk, scores_tx = self.route(x_td)
        # sort the t*k routed copies by expert: each expert's tokens become one slice
        experts_n = experts_tk.flatten()
        order_n = torch.argsort(experts_n, stable=True)
        tokens_n = order_n // self.top_k
        # counted on the device without a host wait (bincount on CUDA reads its input's maximum on the host)
        tokens_per_expert_x = torch.zeros(self.n_experts, dtype=torch.int64, device=experts_n.device)
        tokens_per_expert_x.scatter_add_(0, experts_n, torch.ones_like(experts_n))
        routed_nd = x_td[tokens_n] * gates_tk.flatten()[order_n, None].to(x_td.dtype)
        routed_nd = self.dispatcher(routed_nd, tokens_per_expert_x, self.experts)

        out_td = self.shared_expert(x_td) if self.shared_expert is not None else torch.zeros_like(x_td)
        out_td = out_td.index_add(0, tokens_n, routed_nd.to(out_td.dtype))
        if self.training:
            self.tokens_per_expert += tokens_per_expert_x.detach().float()
            self.aux_loss = self._switch_aux_loss(scores_tx, tokens_per_expert_x) if self.aux_loss_weight else None
        return out_td.view_as(x_bsd)

    def _switch_aux_loss(self, scores_tx: torch.Tensor, tokens_per_expert_x: torch.Tensor) -> torch.Tensor:
        """Switch Transformer's balance loss ``E * sum_i f_i * p_i``: ``f_i`` the share of routed
        copies expert ``i`` received, ``p_i`` its mean normalised score; 1.0 when balanced."""
        share_x = tokens_per_expert_x.float() / tokens_per_expert_x.sum()
        probs_x = (scores_tx / scores_tx.sum(dim=-1, keepdim=True)).mean(dim=0)
        return self.aux_loss_weight * self.n_experts * (share_x * probs_x).sum()

    def init_weights(self, init_std: float, out_std: float, generator: torch.Generator | None) -> None:
        _trunc_normal(self.router.weight, init_std, generator)
        self.experts.init_weights(init_std, out_std, generator)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(init_std, out_std, generator)
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()


class ExpertDispatcher:
    """Carries the expert-sorted token copies to the experts and back: locally, or over ranks
    (:class:`workloads.llama.expert_parallel.AllToAllDispatcher`)."""

    def __call__(self, routed_nd: torch.Tensor, tokens_per_expert_x: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        raise NotImplementedError


class LocalDispatcher(ExpertDispatcher):
    """Every expert lives in this process: run them in place."""

    def __call__(self, routed_nd: torch.Tensor, tokens_per_expert_x: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        return experts(routed_nd, tokens_per_expert_x)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE feed-forwards, in layer order."""
    return [module for module in model.modules() if isinstance(module, MoE)]


@torch.no_grad()
def update_expert_bias(
    model: nn.Module, coeff: float, process_groups: Sequence[torch.distributed.ProcessGroup] = ()
) -> list[torch.Tensor]:
    """The aux-loss-free balancing step, run between optimiser steps.

    For each MoE layer: the load (routed copies per expert since the last call, summed over the
    ranks of each of ``process_groups`` in turn -- the data-parallel ranks, which see different
    tokens -- so every rank moves its bias alike) is compared with the mean load;
    ``bias += coeff * sign(mean - load)``, then the bias is re-centred to mean zero (only
    differences between experts matter to the top-k). Counters reset. Returns each layer's load.
    With ``coeff == 0`` it only collects and resets the loads.
    """
    layers = moe_layers(model)
    if not layers:
        return []
    loads_lx = torch.stack([layer.tokens_per_expert for layer in layers])
    for group in process_groups:
        torch.distributed.all_reduce(loads_lx, group=group)
    for layer, load_x in zip(layers, loads_lx, strict=True):
        if coeff:
            layer.expert_bias += coeff * torch.sign(load_x.mean() - load_x)
            layer.expert_bias -= layer.expert_bias.mean()
        layer.tokens_per_expert.zero_()
    return list(loads_lx)


@torch.no_grad()
def skew_routers(model: nn.Module, skew: float, seed: int) -> None:
    """Tilt every router towards few experts (``workload.router_init_skew``): blend its weights with a
    rank-one matrix ``a_e * u`` (one shared direction ``u``, expert strengths ``a_e`` spread from -1 to 1),
    so the top-1 choice mostly depends on which side of ``u`` a token lies, and the experts at the ends
    of ``a`` get most tokens. ``skew`` is the blend's weight of the tilt."""
    generator = torch.Generator().manual_seed(seed + 17)
    for layer in moe_layers(model):
        weight = layer.router.weight
        direction_d = torch.randn(weight.shape[1], generator=generator)
        strength_x = torch.linspace(-1.0, 1.0, weight.shape[0])
        tilt = torch.outer(strength_x, direction_d).to(weight)
        tilt *= weight.norm() / tilt.norm()  # as strong as the initial weights
        weight.mul_(1 - skew).add_(skew * tilt)


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the MoE layers' auxiliary losses from the last training forward (None if off)."""
    losses = [layer.aux_loss for layer in moe_layers(model) if layer.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def _trunc_normal(weight: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)


__all__ = ["grouped_mm", "grouped_mm_loop", "local_tensor", "MoE", "GroupedExperts", "SharedExpert", "ExpertDispatcher",
           "LocalDispatcher", "moe_layers", "update_expert_bias", "skew_routers", "moe_aux_loss"]
