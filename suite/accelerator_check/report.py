"""The accelerator check's report: ``check.md`` (one table row per step, the codec's table, each
failure's command and reason) and the facts about the machine at its head."""

from __future__ import annotations

from typing import Any

from suite.accelerator_check.framework import FAIL, Outcome


def _figure(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def markdown(outcomes: list[Outcome], header: dict[str, Any]) -> str:
    lines = ["# cobench accelerator check", "",
             *[f"- {key}: {value}" for key, value in header.items()], "",
             "| step | status | seconds | figures | reason |", "| --- | --- | ---: | --- | --- |"]
    for o in outcomes:
        figures = ", ".join(f"{k} {_figure(v)}" for k, v in o.figures.items() if k != "table")
        reason = o.reason.splitlines()[0][:200] if o.reason else ""
        lines.append(f"| {o.step} | {o.status} | {o.seconds:.0f} | {figures} | {reason} |")
    for o in outcomes:
        if "table" in o.figures:
            lines += ["", f"## {o.step}: encode + decode, {o.figures.get('device')} ({o.figures.get('kernel')})", "",
                      "| message | codec | GB/s | vs bf16 cast | ratio | violations |",
                      "| ---: | --- | ---: | ---: | ---: | ---: |"]
            lines += [f"| {r['bytes'] >> 10} KiB | {r['codec']} | {r['gb_per_s']:.2f} | {r['vs_bf16_cast']:.2f} | "
                      f"{r['ratio']:.2f} | {r.get('bound_violations', '')} |" for r in o.figures["table"]]
    failed = [o for o in outcomes if o.status == FAIL]
    for o in failed:
        lines += ["", f"## {o.step}: FAIL", "", f"`{o.command}`" if o.command else "", "", "```", o.reason, "```"]
    return "\n".join(lines) + "\n"


def header_facts(dry_run: bool) -> dict[str, Any]:
    import platform

    import torch

    facts: dict[str, Any] = {"mode": "dry run on the CPU" if dry_run else "device", "torch": torch.__version__,
                             "python": platform.python_version(), "host": platform.node()}
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is not None and not dry_run:
        from harness.platform import device_name

        facts["device"] = device_name(torch.device(accelerator.type, 0))
        facts["devices"] = torch.accelerator.device_count()
        if torch.version.cuda:
            facts["cuda"] = torch.version.cuda
    return facts
