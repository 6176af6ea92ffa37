"""Our Llama (``workloads.llama.model``) run with a KV cache: batched prefill and one-token decode.

The weights and modules are the training model's, used read-only; only attention is re-done here,
because serving attends to keys and values kept from earlier steps instead of recomputing them.
Shape suffixes as in the model: ``b`` batch (cache slots), ``s`` sequence, ``l`` cached length,
``d`` model dim, ``h`` query heads, ``g`` key/value heads, ``e`` head dim, ``v`` vocabulary.

The cache is slot-based: row ``b`` of every layer's cache belongs to one running request, and the
running requests always hold the rows ``0 .. n-1`` (:meth:`KVCache.move` fills a finished request's
row with the last one), so every step reads plain slices, never a gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workloads.llama.model import ModelArgs, Transformer, apply_rope


def check_servable(args: ModelArgs) -> None:
    """Raise ``ValueError`` for model features the cached decoder does not implement yet."""
    llama4 = {
        "nope_layer_interval": args.nope_layer_interval,
        "attention_chunk_size": args.attention_chunk_size,
        "use_qk_norm": args.use_qk_norm or None,
        "attn_temperature_tuning": args.attn_temperature_tuning or None,
        "n_routed_experts": args.n_routed_experts or None,
    }
    used = [name for name, value in llama4.items() if value is not None]
    if used:
        raise ValueError(f"the cached decoder serves dense Llama 3 models; this one uses Llama 4 features {used}. "
                         "Pick a dense preset (tiny, llama3_8b, ...)")


class KVCache:
    """Keys and values of every layer for ``slots`` requests of up to ``max_len`` tokens each,
    shape ``(slots, kv_heads, max_len, head_dim)`` per layer."""

    def __init__(self, args: ModelArgs, slots: int, max_len: int, dtype: torch.dtype, device: torch.device):
        shape = (slots, args.kv_heads, max_len, args.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.slots, self.max_len = slots, max_len

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions into slot ``dst`` (compaction)."""
        for cache in (*self.keys, *self.values):
            cache[dst, :, :length] = cache[src, :, :length]


class CachedDecoder:
    """Runs a :class:`~workloads.llama.model.Transformer`'s weights over a :class:`KVCache`."""

    def __init__(self, model: Transformer):
        check_servable(model.args)
        self.model = model.eval()
        self.args = model.args

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        weight = self.model.tok_embeddings.weight
        return KVCache(self.args, slots, max_len, weight.dtype, weight.device)

    @torch.inference_mode()
    def prefill(self, tokens_bs: torch.Tensor, lengths_b: torch.Tensor, first_slot: int,
                cache: KVCache) -> torch.Tensor:
        """Prompts (right-padded to one length) into slots ``first_slot ..``; returns the float32 logits
        after each prompt's last real token, ``(b, vocab)``.

        Right padding needs no mask: a real token sits before every pad of its row, so causal attention
        keeps pads out of its result; the pads' keys land in the cache beyond the row's length, where
        decoding masks them out and later overwrites them.
        """
        b, s = tokens_bs.shape
        rows = slice(first_slot, first_slot + b)
        cos_se, sin_se = self.model.rope_cos[:s], self.model.rope_sin[:s]
        h_bsd = self.model.tok_embeddings(tokens_bs)
        for i, layer in enumerate(self.model.layers):
            attn = layer.attention
            x_bsd = layer.attention_norm(h_bsd)
            q_bhse, k_bgse, v_bgse = self._qkv(attn, x_bsd, cos_se, sin_se)
            cache.keys[i][rows, :, :s] = k_bgse
            cache.values[i][rows, :, :s] = v_bgse
            out_bhse = F.scaled_dot_product_attention(q_bhse, k_bgse, v_bgse, is_causal=True, enable_gqa=True)
            h_bsd = h_bsd + attn.wo(out_bhse.transpose(1, 2).reshape(b, s, -1))
            h_bsd = h_bsd + layer.feed_forward(layer.ffn_norm(h_bsd))
        last_bd = h_bsd[torch.arange(b, device=h_bsd.device), lengths_b - 1]
        return self.model.output(self.model.norm(last_bd)).float()

    @torch.inference_mode()
    def decode(self, tokens_b: torch.Tensor, positions_b: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One new token for each of the first ``b`` slots, at ``positions_b`` (= tokens cached so far);
        returns the float32 next-token logits ``(b, vocab)``."""
        b = tokens_b.shape[0]
        span = int(positions_b.max()) + 1
        rows = torch.arange(b, device=tokens_b.device)
        visible_b11l = (torch.arange(span, device=tokens_b.device) <= positions_b[:, None])[:, None, None, :]
        cos_b11e = self.model.rope_cos[positions_b][:, None, None, :]
        sin_b11e = self.model.rope_sin[positions_b][:, None, None, :]
        h_bsd = self.model.tok_embeddings(tokens_b[:, None])
        for i, layer in enumerate(self.model.layers):
            attn = layer.attention
            q_bhse, k_bgse, v_bgse = self._qkv(attn, layer.attention_norm(h_bsd), cos_b11e, sin_b11e)
            cache.keys[i][rows, :, positions_b] = k_bgse[:, :, 0]
            cache.values[i][rows, :, positions_b] = v_bgse[:, :, 0]
            keys_bgle, values_bgle = cache.keys[i][:b, :, :span], cache.values[i][:b, :, :span]
            out_bhse = F.scaled_dot_product_attention(q_bhse, keys_bgle, values_bgle, attn_mask=visible_b11l,
                                                      enable_gqa=True)
            h_bsd = h_bsd + attn.wo(out_bhse.transpose(1, 2).reshape(b, 1, -1))
            h_bsd = h_bsd + layer.feed_forward(layer.ffn_norm(h_bsd))
        return self.model.output(self.model.norm(h_bsd[:, 0])).float()

    @staticmethod
    def _qkv(attn: torch.nn.Module, x_bsd: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = x_bsd.shape
        q_bhse = attn.wq(x_bsd).view(b, s, attn.n_heads, attn.head_dim).transpose(1, 2)
        k_bgse = attn.wk(x_bsd).view(b, s, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
        v_bgse = attn.wv(x_bsd).view(b, s, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
        return apply_rope(q_bhse, cos, sin), apply_rope(k_bgse, cos, sin), v_bgse


__all__ = ["CachedDecoder", "KVCache", "check_servable"]
