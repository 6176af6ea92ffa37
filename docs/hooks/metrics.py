"""MkDocs hook: the metrics page's table is rendered from ``harness.running.metrics.METRIC_DEFINITIONS`` at build time.

docs/metrics.md holds :data:`MARKER` where the table goes; :func:`on_page_markdown` puts
``harness.running.metrics.metric_table()`` there, so the page shows the definitions the code uses and nothing
else. Declared under ``hooks:`` in mkdocs.yml; imports nothing of MkDocs (the tests load it as it is).
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- metrics:table -->"
PAGE = "metrics.md"


def render(markdown: str) -> str:
    """``markdown`` with its one :data:`MARKER` replaced by the metric table."""
    from harness.running.metrics import metric_table

    if markdown.count(MARKER) != 1:
        raise ValueError(f"docs/{PAGE} must hold {MARKER} exactly once, where the metric table goes")
    return markdown.replace(MARKER, metric_table())


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """MkDocs' ``on_page_markdown`` event: render the table into the metrics page, leave the others."""
    return render(markdown) if page.file.src_uri == PAGE else markdown
