"""What one device holds and sends in one training step of a Llama layout: the planner's arithmetic.

Parameters come from the model built on the meta device (no memory allocated, even for 405B), each
assigned to the pipeline stage that holds it (layers split by :func:`workloads.llama.layout.stage_layers`;
the first stage also holds the token embedding, the last the final norm and the output head) and cut the
way the layout cuts it:

- tensor parallelism (``tp``): ``wq wk wv w1 w3`` and the shared expert's ``gate_proj up_proj`` column-wise
  (their output dim / tp), ``wo w2 down_proj`` row-wise (input dim / tp), the token embedding row-wise and the
  output head column-wise (vocabulary / tp), the routed experts' hidden dim / tp; norms and routers whole;
- expert parallelism (``ep``): the routed experts / ep;
- FSDP2 (``dp_shard``): every parameter's dim 0 / dp_shard, rounded up as FSDP2 pads it; routed experts on a
  device mesh are left out (each rank keeps its ``ep × tp`` slice whole, replicated over the ``dp / ep`` ranks
  that hold the same experts: :mod:`workloads.llama.expert_mesh`), without one over ``dp_shard / ep`` ranks
  when ep divides dp_shard, else whole.

Per device, in bytes (parameters and optimizer state float32, as the workload keeps them):

- ``params`` = the stage's sharded parameters × 4; ``grads`` the same; ``optimizer`` = 2 × params (AdamW's
  ``exp_avg`` and ``exp_avg_sq``); ``buffers`` the RoPE tables (and MoE counters);
- ``unsharded`` (FSDP2 wraps the model whenever there is more than one data-parallel rank): the stage's
  parameters outside the blocks (the root module is not resharded after its forward) plus two blocks (the
  one computing and the one prefetched); with ``pp > 1`` the stage's parameters *and* gradients, whole, for
  the step (the workload does not reshard after the forward with a pipeline, and ``torch.distributed.
  pipelining`` turns FSDP2's resharding after backward and gradient sync off until the last microbatch);
- ``activations``: what autograd saves for the microbatches in flight (:func:`layer_saved_bytes`), the
  pipeline's receive buffers and, on the last stage, the logits of each microbatch in flight (the stage keeps
  a microbatch's output until its backward; the workload's schedule returns none), plus the loss's working
  set at its peak; with activation checkpointing each block keeps its input
  only and one block's activations are rebuilt at a time in the backward.

The peak is the larger of the end of the forward (``params + buffers + optimizer`` + the root's unsharded
parameters + the activations, the loss's working set or the two gathered blocks, whichever is larger — the
blocks are gathered again only after the loss; plus the gradients already accumulated when a step has
several microbatches) and the optimizer step (``params + buffers + optimizer + grads``, plus one
params-sized temporary where the workload uses the multi-tensor AdamW: on a device mesh and under FSDP2;
one rank or DDP use the fused one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workloads.llama.args import ModelArgs
from workloads.llama.layout import Layout, stage_of_layer

# linear cross-entropy's logits per chunk (workloads/llama/loss.py): on a CPU, on an accelerator
LOSS_CHUNK_ELEMENTS = {"cpu": 1 << 22, "accelerator": 1 << 27}
COLWISE = ("wq", "wk", "wv", "w1", "w3", "gate_proj", "up_proj")
ROWWISE = ("wo", "w2", "down_proj")


@dataclass(frozen=True)
class ParamShape:
    """One parameter of the meta model: where it sits and how layouts cut it."""

    name: str
    shape: tuple[int, ...]
    layer: int | None  # its block; None for the embedding, the final norm and the output head

    def local_shape(self, tp: int, ep: int) -> list[int]:
        """The shape one tensor-parallel (and expert-parallel) rank holds, before FSDP."""
        shape = list(self.shape)
        leaf = self.name.split(".")[-2] if self.name.endswith(".weight") else self.name.split(".")[-1]
        if ".experts." in self.name:  # stacked routed experts: w1, w3 [x, d, f] and w2 [x, f, d]
            shape[0] //= ep
            shape[1 if leaf == "w2" else 2] //= tp
        elif leaf in COLWISE or self.name in ("tok_embeddings.weight", "output.weight"):
            shape[0] //= tp
        elif leaf in ROWWISE:
            shape[1] //= tp
        return shape

    def numel(self, tp: int = 1, ep: int = 1, fsdp: int = 1) -> int:
        """Elements on one device, FSDP2's padding of dim 0 included."""
        shape = self.local_shape(tp, ep)
        return math.ceil(shape[0] / fsdp) * math.prod(shape[1:])


@dataclass(frozen=True)
class MetaModel:
    """The parameters and buffers of the model built on the meta device."""

    args: ModelArgs
    params: tuple[ParamShape, ...]
    buffer_bytes: int

    @classmethod
    def build(cls, args: ModelArgs) -> MetaModel:
        from workloads.llama.model import Transformer

        with torch.device("meta"):
            model = Transformer(args)
        params = tuple(ParamShape(name, tuple(p.shape), int(name.split(".")[1]) if name.startswith("layers.") else None)
                       for name, p in model.named_parameters())
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        return cls(args, params, buffers)

    def total_params(self) -> int:
        return sum(p.numel() for p in self.params)

    def stage_of(self, param: ParamShape, pp: int) -> int:
        if param.layer is not None:
            return stage_of_layer(self.args.n_layers, pp)[param.layer]
        return 0 if param.name.startswith("tok_embeddings") else pp - 1


def layer_saved_bytes(args: ModelArgs, layer_id: int, tokens: float, compute_bytes: int, tp: int = 1,
                      sequence_parallel: bool = True, weight_elements: float = 0.0) -> float:
    """Bytes autograd saves in one block's forward for ``tokens`` tokens (this model's code, counted tensor by
    tensor; measured on CPU in ``tests/test_plan.py``). ``d`` dim, ``g`` key/value width (kv heads × head
    dim), ``f`` feed-forward width, ``h`` heads; ``c`` the compute dtype's bytes (4 float32, 2 under bf16
    autocast); per token:

    | saved tensor | bytes | with tp |
    |---|---|---|
    | residual input, post-attention residual | 2 × 4d (float32) | / tp with sequence parallelism |
    | the two norms' normalised values | 2 × 4d, 2 × 4 | / tp with sequence parallelism |
    | the norm outputs the linears read | float32 2 × 4d; autocast 5 × 2d (one cast a linear) | whole (all-gathered) |
    | q, k, v after RoPE | c(d + 2g) | / tp |
    | attention output, its log-sum-exp | c·d + 4h | / tp |
    | SwiGLU: w1 x, w3 x, silu(w1 x), product | 4 c·f | / tp |

    So a float32 block saves ``32d + 8g + 16f + 4h + 8`` bytes a token; under autocast ``30d + 4g + 8f + 4h +
    8``, plus the autocast copies of the block's weight matrices (2 bytes × ``weight_elements``, the block's
    matrices on this device, unsharded), saved by the linears once per microbatch. Llama 4's QK norm adds
    ``c(d + g)`` and its statistics on RoPE layers. A mixture-of-experts layer replaces the SwiGLU row by the
    router's scores (4 × experts), the shared expert (4 c·f_e) and, per routed copy (top_k a token), its
    gathered input and output (2 c·d) and the expert's SwiGLU (4 c·f_e); its input is cast three times under
    autocast. Not counted: Llama 4's chunked attention's block copies and the MoE's routing indices.
    """
    d, g, h = args.dim, args.kv_heads * args.head_dim, args.n_heads
    seq_split = tp if sequence_parallel else 1
    autocast = compute_bytes != 4
    residual = (2 * 4 * d + 2 * 4 * d + 2 * 4) / seq_split
    attn_in = 3 * 2 * d if autocast else 4 * d
    attention = (compute_bytes * (d + 2 * g) + compute_bytes * d + 4 * h) / tp
    if args.use_qk_norm and args.uses_rope(layer_id):
        attention += (compute_bytes * (d + g) + 4 * (h + args.kv_heads)) / tp
    if args.is_moe_layer(layer_id):
        f_e = args.moe_hidden_dim
        ffn_in = 3 * 2 * d if autocast else 4 * d
        ffn = (4 * args.n_routed_experts + 4 * compute_bytes * f_e / tp
               + args.moe_top_k * (2 * compute_bytes * d + 4 * compute_bytes * f_e / tp))
    else:
        ffn_in = 2 * 2 * d if autocast else 4 * d
        ffn = 4 * compute_bytes * args.hidden_dim / tp
    weight_copies = 2 * weight_elements if autocast else 0.0
    return tokens * (residual + attn_in + attention + ffn_in + ffn) + weight_copies


def checkpointed_layer_bytes(args: ModelArgs, tokens: float, tp: int = 1, sequence_parallel: bool = True) -> float:
    """With activation checkpointing a block keeps only its input: the float32 residual stream."""
    return tokens * 4 * args.dim / (tp if sequence_parallel else 1)


def fused_loss(layout: Layout) -> bool:
    """Whether the workload computes the loss with the chunked linear cross-entropy (one model call with the
    targets, no logits stored): without tensor or pipeline parallelism. Otherwise the model returns logits
    (vocabulary-sharded under tp) and the loss is ``cross_entropy`` on them (under ``loss_parallel`` with tp)."""
    return layout.tp == 1 and layout.pp == 1


def head_saved_bytes(args: ModelArgs, tokens: float, compute_bytes: int, layout: Layout) -> float:
    """The last stage's final norm and loss, saved for the backward, for one microbatch. The chunked loss
    (:func:`fused_loss`) saves the hidden states' gradient (4d a token) and the output head's gradient
    (vocab × d × 4); otherwise the head saves its input (all-gathered over tp) and the loss the log-softmax of
    the float32 logits (4 × vocab / tp a token), and under autocast the head's weight in the compute dtype."""
    d, vocab, tp = args.dim, args.vocab_size, layout.tp
    norm = tokens * (2 * 4 * d + 4) / (tp if layout.sequence_parallel else 1)
    if fused_loss(layout):
        return norm + tokens * 4 * d + 4 * vocab * d
    head_input = 2 * d if compute_bytes != 4 else 4 * d
    weight_copy = 2 * vocab * d / tp if compute_bytes != 4 else 0.0
    return norm + tokens * (head_input + 4 * vocab / tp) + weight_copy


def loss_transient_bytes(args: ModelArgs, tokens: float, compute_bytes: int, layout: Layout,
                         device_kind: str) -> float:
    """The loss's working set beyond what it saves, at its peak. The chunked loss: one chunk's float32
    logits turned into their gradient, the per-chunk hidden gradients; under autocast also the chunk gradient's
    compute-dtype copy, the head's weight in the compute dtype and its per-chunk weight gradient before it is
    added in float32 (``rows × vocab × 6 + tokens × d × 6 + vocab × d × 8``). On logits: the backward's
    float32 gradients of the log-softmax and of the logits (three under ``loss_parallel``, which also makes
    ``exp`` of the log-softmax), plus the compute-dtype logits under autocast."""
    vocab, d, tp = args.vocab_size, args.dim, layout.tp
    if fused_loss(layout):
        rows = max(1, min(tokens, LOSS_CHUNK_ELEMENTS[device_kind] // vocab))
        if compute_bytes == 4:
            return rows * vocab * 4 + tokens * d * 4
        return (rows * vocab * (4 + compute_bytes) + tokens * d * (compute_bytes + 4)
                + vocab * d * (2 * compute_bytes + 4))
    gradients = 3 if tp > 1 else 2
    return tokens * vocab / tp * (gradients * 4 + (compute_bytes if compute_bytes != 4 else 0))


@dataclass(frozen=True)
class Footprint:
    """One device's bytes in the layout's fullest pipeline stage, and its traffic per step."""

    stage: int  # the stage whose peak is largest (without activation checkpointing)
    params: float
    grads: float
    optimizer: float
    buffers: float
    unsharded: float
    activations: float
    activations_ac: float
    peak: float
    peak_ac: float
    bubble: float
    comm_tp: float
    comm_pp: float
    comm_dp: float
    comm_ep: float


def microbatches(layout: Layout, grad_accum_steps: int) -> int:
    return layout.pp_microbatches if layout.pp > 1 else grad_accum_steps


def in_flight(layout: Layout, stage: int, count: int) -> int:
    """Microbatches whose activations a stage holds at once: all of them under GPipe, ``pp - stage`` under
    1F1B (the first stage holds the most); one without a pipeline (accumulation runs them in turn)."""
    if layout.pp == 1:
        return 1
    return count if layout.pp_schedule == "gpipe" else min(layout.pp - stage, count)


def footprint(model: MetaModel, layout: Layout, batch_size: int, seq_len: int, compute_bytes: int,
              grad_accum_steps: int = 1, device_kind: str = "accelerator") -> Footprint:
    """Bytes per device for ``layout`` (module doc), taking the pipeline stage with the largest peak."""
    args, tp, pp, sp = model.args, layout.tp, layout.pp, layout.sequence_parallel
    count = microbatches(layout, grad_accum_steps)
    tokens = batch_size // layout.dp * seq_len / count  # one microbatch on one data-parallel rank
    if layout.on_mesh:  # FSDP2 leaves the experts alone (workloads/llama/expert_mesh.py)
        fsdp_experts = 1
    else:
        fsdp_experts = layout.dp_shard // layout.ep if layout.dp_shard % layout.ep == 0 else 1
    matrices = [0.0] * args.n_layers
    for p in model.params:
        if p.layer is not None and len(p.shape) > 1:
            matrices[p.layer] += p.numel(tp, layout.ep)
    per_layer = [layer_saved_bytes(args, i, tokens, compute_bytes, tp, sp, matrices[i]) for i in range(args.n_layers)]
    best: Footprint | None = None
    for stage in range(pp):
        mine = [p for p in model.params if model.stage_of(p, pp) == stage]
        shard = {p.name: fsdp_experts if ".experts." in p.name else layout.dp_shard for p in mine}
        params = 4.0 * sum(p.numel(tp, layout.ep, shard[p.name]) for p in mine)
        whole = {p.name: 4.0 * p.numel(tp, layout.ep) for p in mine}
        layers = sorted({p.layer for p in mine if p.layer is not None})
        gathered_by_fsdp = [p for p in mine if not (layout.on_mesh and ".experts." in p.name)]
        block = {i: sum(whole[p.name] for p in gathered_by_fsdp if p.layer == i) for i in layers}
        gathered, gathered_blocks = 0.0, 0.0  # what FSDP2 (HSDP with replicas) holds unsharded
        if layout.dp > 1 and pp > 1:  # the stage's parameters and gradients, whole, for the step
            gathered = 2 * sum(whole.values())
        elif layout.dp > 1:  # the root's for the step; two blocks at a time, gathered again after the loss
            gathered = sum(whole[p.name] for p in mine if p.layer is None)
            gathered_blocks = 2 * max(block.values(), default=0.0)
        flight = in_flight(layout, stage, count)
        saved = sum(per_layer[i] for i in layers)
        saved_ac = sum(checkpointed_layer_bytes(args, tokens, tp, sp) for _ in layers)
        extra = 8 * tokens if stage == 0 else 0.0  # the token ids the embedding keeps
        held = 0.0  # for the whole step, whatever is in flight
        if pp > 1:  # the pipeline's receive buffers, one per microbatch: activations in, their gradients back
            boundary = tokens * 4 * args.dim / (tp if sp else 1)
            held += count * boundary * ((stage > 0) + (stage < pp - 1))
        transient = 0.0
        if stage == pp - 1:
            extra += head_saved_bytes(args, tokens, compute_bytes, layout)
            transient = loss_transient_bytes(args, tokens, compute_bytes, layout, device_kind)
            if pp > 1:  # the stage keeps each microbatch in flight's output, its float32 logits, until its backward
                held += flight * tokens * 4 * args.vocab_size / tp
        rebuilt = max((per_layer[i] for i in layers), default=0.0)
        kept, kept_ac = flight * (saved + extra) + held, flight * (saved_ac + extra) + held
        buffers = float(model.buffer_bytes)
        static = params + buffers + 2 * params + gathered
        static += params if count > 1 and not (pp > 1 and layout.dp > 1) else 0.0  # gradients accumulating
        multi_tensor = layout.world_size > 1 and (layout.on_mesh or layout.dp_shard > 1)  # foreach AdamW
        at_step = params + buffers + 2 * params + params + (params if multi_tensor else 0.0)
        # the loss's working set and the gathered blocks are not held at once; a rebuilt block's are
        peak = max(static + kept + max(transient, gathered_blocks), at_step)
        peak_ac = max(static + kept_ac + max(transient, rebuilt + gathered_blocks), at_step)
        comm = _traffic(model, layout, mine, whole, tokens, count, compute_bytes)
        candidate = Footprint(stage, params, params, 2 * params, buffers, gathered + gathered_blocks,
                              kept + transient, kept_ac + max(transient, rebuilt),
                              peak, peak_ac, (pp - 1) / (count + pp - 1) if pp > 1 else 0.0, *comm)
        if best is None or candidate.peak > best.peak:
            best = candidate
    assert best is not None
    return best


def _traffic(model: MetaModel, layout: Layout, mine: list[ParamShape], whole: dict[str, float], tokens: float,
             count: int, compute_bytes: int) -> tuple[float, float, float, float]:
    """Bytes one device sends per step for tp, pp, dp and ep, ring collectives (an all-gather or reduce-scatter of
    ``n`` bytes over ``k`` ranks sends ``(k-1)/k × n`` from each; an all-reduce twice that).

    - tp, per block and microbatch: the two norm outputs all-gathered (float32) and the two row-parallel
      outputs reduce-scattered (compute dtype) in the forward, the transposes in the backward, again in the
      forward with activation checkpointing left out; plus the embedding's and the head's (2 × 4d each);
    - pp: the stage's output forward and its input's gradient backward, float32 residual (/ tp with sequence
      parallelism), for every microbatch;
    - dp: FSDP2 all-gathers the stage's parameters in the forward and again in the backward and
      reduce-scatters the gradients (float32) — per microbatch without a pipeline, once per step with one
      (it keeps them unsharded between microbatches); HSDP all-reduces the sharded gradients over replicas.
      On a device mesh a MoE's routed experts are not FSDP2's: their gradients are all-reduced once a step
      over the ``dp / ep`` ranks that hold the same experts;
    - ep, per MoE layer and microbatch: each of the rank's tokens goes to ``top_k`` experts, a share
      ``(ep-1)/ep`` of them on other ranks under balanced routing — out as float32 (the normed residual),
      back as the experts' compute-dtype products, and their gradients the other way in the backward. Every
      tp rank of a data-parallel rank exchanges the whole of its tokens (the MoE layer's input is made whole
      on each); the per-expert counts sent beside them are left out.
    """
    args, tp, pp = model.args, layout.tp, layout.pp
    d, step_tokens = args.dim, tokens * count
    layers = len({p.layer for p in mine if p.layer is not None})
    comm_tp = 0.0
    if tp > 1:
        per_token = layers * (2 * 4 + 2 * compute_bytes) * 2 + sum(
            2 * 4 for p in mine if p.name in ("tok_embeddings.weight", "output.weight"))
        comm_tp = (tp - 1) / tp * step_tokens * d * per_token
    comm_pp = 2 * step_tokens * 4 * d / (tp if layout.sequence_parallel else 1) if pp > 1 else 0.0
    expert_bytes = sum(whole[p.name] for p in mine if layout.on_mesh and ".experts." in p.name)
    stage_bytes = sum(whole.values()) - expert_bytes
    edp = layout.dp // layout.ep
    comm_dp = 2 * (edp - 1) / edp * expert_bytes
    if layout.dp_shard > 1:
        gathers = 1 if pp > 1 else count
        comm_dp += (layout.dp_shard - 1) / layout.dp_shard * stage_bytes * 3 * gathers
    if layout.dp_replicate > 1:
        comm_dp += 2 * (layout.dp_replicate - 1) / layout.dp_replicate * stage_bytes / layout.dp_shard
    moe_layers = sum(args.is_moe_layer(i) for i in {p.layer for p in mine if p.layer is not None})
    comm_ep = (layout.ep - 1) / layout.ep * step_tokens * args.moe_top_k * d * (4 + compute_bytes) * 2 * moe_layers
    return comm_tp, comm_pp, comm_dp, comm_ep


__all__ = ["Footprint", "MetaModel", "ParamShape", "checkpointed_layer_bytes", "footprint", "layer_saved_bytes"]
