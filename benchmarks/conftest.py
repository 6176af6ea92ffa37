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
