"""Performance figures (pytest-benchmark): `nox -s perf`. Reported, never asserted as gates."""


def pytest_terminal_summary(terminalreporter) -> None:
    """The codec comparison as one table (benchmarks/test_compression_speed.py), after pytest-benchmark's."""
    import sys

    module = next((m for name, m in list(sys.modules.items()) if name.endswith("test_compression_speed")), None)
    lines = module.codec_table() if module is not None else []
    if lines:
        terminalreporter.write_sep("-", "codecs side by side")
        for line in lines:
            terminalreporter.write_line(line)


def hf_llama_config(args):
    """transformers' ``LlamaConfig`` of our ``ModelArgs`` (the inverse of ``workloads.llama.from_hf_config``),
    for the side-by-side benchmarks against ``LlamaForCausalLM``."""
    import transformers

    return transformers.LlamaConfig(
        hidden_size=args.dim, intermediate_size=args.hidden_dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab_size,
        rms_norm_eps=args.norm_eps, max_position_embeddings=max(args.max_seq_len, args.rope_original_max_seq_len),
        rope_scaling={"rope_type": "llama3", "factor": args.rope_scale_factor,
                      "low_freq_factor": args.rope_low_freq_factor, "high_freq_factor": args.rope_high_freq_factor,
                      "original_max_position_embeddings": args.rope_original_max_seq_len},
        rope_theta=args.rope_theta, tie_word_embeddings=False, attn_implementation="sdpa",
    )
