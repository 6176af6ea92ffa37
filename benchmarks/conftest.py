"""Performance figures (pytest-benchmark): `nox -s perf`. Reported, never asserted as gates."""


def pytest_terminal_summary(terminalreporter) -> None:
    """The side-by-side comparisons as tables (codecs; Llama against transformers), after pytest-benchmark's."""
    import sys

    tables = (("test_compression_speed", "codec_table", "codecs side by side"),
              ("test_llama_vs_transformers", "side_by_side_table", "llama vs transformers, interleaved"))
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
