"""Performance figures (pytest-benchmark): `nox -s perf`. Reported, never asserted as gates."""


def pytest_terminal_summary(terminalreporter) -> None:
    """The side-by-side comparisons as tables (codecs; Llama against transformers), after pytest-benchmark's."""
    import sys

    tables = (("test_compression_speed", "codec_table", "codecs side by side"),
              ("test_llama_vs_transformers", "side_by_side_table", "llama vs transformers, interleaved"),
              ("test_moe_vs_transformers", "side_by_side_table", "llama4 MoE layer vs transformers, interleaved"))
    for suffix, table, title in tables:
        module = next((m for name, m in list(sys.modules.items()) if name.endswith(suffix)), None)
        lines = getattr(module, table)() if module is not None else []
        if lines:
            terminalreporter.write_sep("-", title)
            for line in lines:
                terminalreporter.write_line(line)


def hf_llama_config(args):
    """transformers' ``LlamaConfig`` of our ``ModelArgs`` (the inverse of ``workloads.llama.from_hf_config``),
    for the side-by-side benchmarks against ``LlamaForCausalLM``."""
    import transformers

    return transformers.LlamaConfig(
        hidden_size=args.dim, intermediate_size=args.hidden_dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab_size,
        rms_norm_eps=args.norm_eps,
        # above the scaled-RoPE's original length (transformers warns at every forward otherwise); llama3 RoPE
        # frequencies do not depend on it
        max_position_embeddings=max(args.max_seq_len, args.rope_original_max_seq_len + 1),
        rope_scaling={"rope_type": "llama3", "factor": args.rope_scale_factor,
                      "low_freq_factor": args.rope_low_freq_factor, "high_freq_factor": args.rope_high_freq_factor,
                      "original_max_position_embeddings": args.rope_original_max_seq_len},
        rope_theta=args.rope_theta, tie_word_embeddings=False, attn_implementation="sdpa",
    )


def interleaved_times(variants: dict, rounds: int, steps: int) -> dict:
    """Seconds per call of each variant (a zero-argument callable), timed in ``rounds`` interleaved
    rounds of ``steps`` calls whose order alternates, so the machine's drift hits all alike."""
    import time

    times: dict = {key: [] for key in variants}
    for r in range(rounds):
        for key in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            start = time.perf_counter()
            for _ in range(steps):
                variants[key]()
            times[key].append((time.perf_counter() - start) / steps)
    return times


def ratio_text(slow: list[float], fast: list[float]) -> str:
    """The median of the per-round ratios ``slow / fast``, with their min-max range."""
    import statistics

    per_round = sorted(a / b for a, b in zip(slow, fast, strict=True))
    return f"{statistics.median(per_round):.2f}x (rounds {per_round[0]:.2f} ... {per_round[-1]:.2f})"
