"""Performance figures (pytest-benchmark): `nox -s perf`. Reported, never asserted as gates."""
