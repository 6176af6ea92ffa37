"""The output head and the cross-entropy loss in one pass over token chunks, logits never stored.

A language model's last linear layer makes ``tokens x vocab`` logits (a batch of 8 x 256 tokens
over a 8,192 vocabulary: 64 MiB in float32; with Llama 3's 128 k vocabulary, 1 GiB), which the
usual ``F.cross_entropy(model(x), y)`` writes, reads back for the softmax, and keeps for the
backward (the log-softmax output, then a zero-filled gradient of the same size). Here each chunk's
logits are made, turned into that chunk's loss and its gradient (``softmax - onehot``), and
multiplied back into the hidden-state and weight gradients at once, while they are still in cache
(the approach of Liger-Kernel's fused linear cross-entropy and torchtune's chunked loss). The
FLOPs are those of the linear layer's forward and backward; the memory traffic of the logits is
gone. Gradients are computed in the forward, only when autograd asks for them (not under
``torch.no_grad``, so evaluation is the chunked forward alone).

Under autocast the matrix products run in its dtype (the softmax in float32), as the unfused
``linear`` would; the weight gradient is accumulated in the weight's dtype.
"""

from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100  # targets equal to this are not scored (F.cross_entropy's default)
# Logits per chunk. On a CPU, 16 MiB of float32 stays in its cache. On an accelerator a chunk must instead be
# tall enough to keep its matrix units busy and few enough that the per-chunk weight-gradient sum (a
# vocab x dim float32 tensor each time) and the launches stay small: with Llama 3's 128 k vocabulary the CPU
# size is 32 rows, 256 chunks for 8,192 tokens — measured on an H200, a 2-layer 8B-shaped model then took
# 1,065 ms a step (4.6 % MFU), and under torch.compile (which traces the chunk loop unrolled) it ran out of the
# device's 139 GiB. Here 512 MiB of float32 logits: 1,024 rows at 128 k, 16,384 at tiny's 8 k.
_CHUNK_ELEMENTS = 1 << 22  # on a CPU
_ACCELERATOR_CHUNK_ELEMENTS = 1 << 27


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden_nd: torch.Tensor, weight_vd: torch.Tensor, targets_n: torch.Tensor,
                compute_dtype: torch.dtype) -> torch.Tensor:
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, vocab = hidden_nd.shape[0], weight_vd.shape[0]
        elements = _CHUNK_ELEMENTS if hidden_nd.device.type == "cpu" else _ACCELERATOR_CHUNK_ELEMENTS
        chunk = max(1, min(n, elements // vocab))
        weight = weight_vd.to(compute_dtype)
        scored = targets_n != IGNORE_INDEX
        exact = torch.promote_types(compute_dtype, torch.float32)  # the softmax's dtype: float32 at least
        count = scored.sum().clamp(min=1).to(exact)
        total = torch.zeros((), dtype=exact, device=hidden_nd.device)
        grad_hidden = [] if want_hidden else None
        grad_weight = torch.zeros_like(weight_vd, dtype=exact) if want_weight else None
        for start in range(0, n, chunk):
            h_cd = hidden_nd[start:start + chunk].to(compute_dtype)
            t_c, keep_c = targets_n[start:start + chunk], scored[start:start + chunk]
            logits_cv = (h_cd @ weight.t()).to(exact)
            lse_c = torch.logsumexp(logits_cv, dim=-1)
            safe_t = torch.where(keep_c, t_c, 0)
            picked_c = logits_cv.gather(1, safe_t[:, None]).squeeze(1)
            total = total + ((lse_c - picked_c) * keep_c).sum()
            if grad_hidden is None and grad_weight is None:
                continue
            # d(loss_sum)/d(logits) = softmax - onehot, zero on unscored rows; made in place in the logits
            grad_cv = logits_cv.sub_(lse_c[:, None]).exp_()
            grad_cv[torch.arange(grad_cv.shape[0], device=grad_cv.device), safe_t] -= 1.0
            grad_cv.mul_(keep_c[:, None])
            grad_cv = grad_cv.to(compute_dtype)
            if grad_hidden is not None:
                grad_hidden.append(grad_cv @ weight)
            if grad_weight is not None and compute_dtype == exact:
                torch.addmm(grad_weight, grad_cv.t(), h_cd, out=grad_weight)  # (addmm_ escapes FLOP counters)
            elif grad_weight is not None:
                grad_weight += (grad_cv.t() @ h_cd).to(exact)
        ctx.save_for_backward(
            torch.cat(grad_hidden).to(hidden_nd.dtype) if grad_hidden is not None else None,
            grad_weight.to(weight_vd.dtype) if grad_weight is not None else None,
            count,
        )
        return total / count

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad_loss / count
        return (grad_hidden * scale.to(grad_hidden.dtype) if grad_hidden is not None else None,
                grad_weight * scale.to(grad_weight.dtype) if grad_weight is not None else None, None, None)


def linear_cross_entropy(hidden_nd: torch.Tensor, weight_vd: torch.Tensor, targets_n: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(hidden_nd @ weight_vd.T, targets_n)`` (mean over the scored targets; targets
    equal to ``IGNORE_INDEX`` are not scored), without materialising the logits (module doc)."""
    device_type = hidden_nd.device.type
    compute_dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                     else hidden_nd.dtype)
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(hidden_nd, weight_vd, targets_n, compute_dtype)
