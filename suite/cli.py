"""The ``cobench`` command. It sits at the top layer so it can reach suites as well as the
harness; ``run`` itself is the harness's Hydra app."""

from __future__ import annotations

import sys

USAGE = """usage: cobench COMMAND [ARGS]

commands:
  run   [OVERRIDES] [-m]   run one benchmark, e.g. `cobench run workload=llama runner.steps=50`;
                           -m sweeps: `cobench run -m workload.batch_size=2,4`
  suite NAME [OVERRIDES]   run a suite (conf/suite/NAME.yaml) under one MLflow parent run,
                           e.g. `cobench suite smoke results_dir=/tmp/res`
  list                     the workloads, suites and platforms this checkout knows
  trace capture|generate|export ...
                           generated trace benchmarks: `cobench trace --help`
  qualify [OVERRIDES]      run the qualification suite and check the platform's gates:
                           `cobench qualify --help`
  compare [OPTIONS]        platform × benchmark table from MLflow: `cobench compare --help`
  report [OPTIONS]         MLPerf-style submission folder + HTML report: `cobench report --help`

`cobench run --help` shows the composed config and every override group.
"""


def _list() -> int:
    from harness.config import CONF_DIR
    from workloads import discover

    print("workloads:")
    for name, spec in sorted(discover().items()):
        print(f"  {name:12s} {spec.description}")
    for group in ("suite", "platform", "tracking"):
        names = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        print(f"{group}s: {', '.join(names)}")
    return 0


def _suite(args: list[str]) -> int:
    from harness.cli import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, sigterm_as_interrupt
    from harness.distributed import env_dist_info
    from harness.runner import STATUS_FINISHED, STATUS_SKIPPED
    from harness.summary import print_summary
    from harness.tracking import TrackingError
    from suite.runner import run_suite

    if not args or args[0].startswith("-") or "=" in args[0]:
        print("cobench: error: `cobench suite` needs a suite name, e.g. `cobench suite smoke`", file=sys.stderr)
        return EXIT_BAD_INPUT
    sigterm_as_interrupt()
    try:
        outcome = run_suite(args[0], args[1:])
    except (ValueError, TrackingError) as err:
        print(f"cobench: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("cobench: interrupted; open MLflow runs were closed as KILLED", file=sys.stderr)
        return EXIT_INTERRUPTED
    results = outcome.results
    if env_dist_info().is_main:
        print_summary(results, title=f"suite {args[0]}: {outcome.wall_s:.1f} s wall",
                      extra_metrics=outcome.suite.summary_metrics)
    ok = all(r.status in (STATUS_FINISHED, STATUS_SKIPPED) for r in results)
    return EXIT_OK if ok else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command == "run":
        from harness.cli import run_main

        return run_main(rest)
    if command == "suite":
        return _suite(rest)
    if command == "list":
        return _list()
    # Each further command lives in its own module, which parses its own arguments.
    if command == "trace":
        from suite.trace_cli import main as trace_main

        return trace_main(rest)
    if command == "qualify":
        from suite.qualify import main as qualify_main

        return qualify_main(rest)
    if command == "compare":
        from suite.compare import main as compare_main

        return compare_main(rest)
    if command == "report":
        from suite.report import main as report_main

        return report_main(rest)
    print(f"cobench: error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
