"""``cobench trace``: capture a trace bundle, generate a benchmark spec from it, judge its fidelity, export it to
Chakra, predict its step under changes (what-if: the subcommands of ``suite/whatif_cli.py``).

    cobench trace capture [--out DIR] [--steps K] [--warmup W] [--baseline-steps N] [OVERRIDES]
    cobench trace generate BUNDLE [--out SPEC] [--scope RE] [--op RE] [--exclude-op RE]
                           [--steps I,J] [--window-ms A:B] [--repeat N] [--obfuscate]
    cobench trace export --format chakra BUNDLE [--out DIR]
    cobench trace fidelity [--rounds R] [--round-steps K] [--warmup W] [--steps N] [--baseline-steps B] [OVERRIDES]
    cobench trace zoo [--programs A,B] [--judgements J] [--rounds R] [--round-steps K] [--out DIR] [OVERRIDES]
    cobench trace predict BUNDLE [workload.n_layers=N] [workload.batch_size=B] [workload.seq_len=S] [world_size=W]
                          [--calibration FILE] [--target-calibration FILE] [--collectives TABLE]
                          [--sharded-stage FILE] [--gradient-sync FILE | --sync-from table]
                          [--chakra DIR] [--json FILE] [--measure [OVERRIDES]]
    cobench trace calibrate --out FILE [--platform NAME] [--threads N] [--host-allocator steady|system]
    cobench trace measure-pair --out FILE [--steps N] [--warmup W] OVERRIDES --changed CHANGES
    cobench trace predict-validate --out DIR [--rounds R] [--steps K] [--cases layers,batch,ranks] [OVERRIDES]

Replay is a workload like any other: ``cobench run workload=generated workload.spec=SPEC``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness.cli import EXIT_FAILED, EXIT_OK, CommandFailed
from suite import whatif_cli


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cobench trace", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_add_capture, _add_generate, _add_fidelity, _add_zoo, whatif_cli.add_predict,
                whatif_cli.add_predict_validate, whatif_cli.add_measure_pair, whatif_cli.add_calibrate, _add_export):
        add(commands)
    return parser


def _add_capture(commands: argparse._SubParsersAction) -> None:
    cap = commands.add_parser("capture", help="run a registered workload under the execution-trace observer")
    cap.add_argument("--out", type=Path, default=None,
                     help="bundle folder (default <results_dir>/traces/<workload>-<time>)")
    cap.add_argument("--steps", type=int, default=3, help="steps traced (default 3)")
    cap.add_argument("--warmup", type=int, default=10, help="plain steps first, not timed (default 10)")
    cap.add_argument("--baseline-steps", type=int, default=50,
                     help="plain timed steps: the reference the replay is judged against (default 50)")
    cap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. workload=llama workload.preset=tiny")
    cap.set_defaults(handler=_capture)


def _add_generate(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser("generate", help="bundle → portable benchmark spec (one JSON file)")
    gen.add_argument("bundle", type=Path)
    gen.add_argument("--out", type=Path, default=None, help="spec file (default <bundle>/spec.json)")
    gen.add_argument("--scope", help="regex: keep ops under a matching scope (module name, annotation)")
    gen.add_argument("--op", help="regex: keep ops whose name matches, e.g. 'aten::(mm|addmm)'")
    gen.add_argument("--exclude-op", help="regex: drop ops whose name matches")
    gen.add_argument("--steps", help="captured steps to keep, e.g. 0,2")
    gen.add_argument("--window-ms", help="keep ops starting A..B ms into their step, e.g. 0:5")
    gen.add_argument("--repeat", type=int, default=1, help="replay the selection N times per step")
    gen.add_argument("--obfuscate", action="store_true", help="hash scope names, drop host and config")
    gen.set_defaults(handler=_generate)


def _add_fidelity(commands: argparse._SubParsersAction) -> None:
    fid = commands.add_parser("fidelity", help="capture → generate → replay side by side with the source, one "
                                                "MLflow run: the trustworthy fidelity figure")
    fid.add_argument("--rounds", type=int, default=10, help="interleaved rounds, at least (default 10)")
    fid.add_argument("--round-steps", type=int, default=10, help="samples of each side per round (default 10)")
    fid.add_argument("--budget-s", type=float, default=60.0, help="seconds of rounds at most: rounds are added until "
                                                                  "the interval is within ±2.5 %% (default 60)")
    fid.add_argument("--warmup", type=int, default=5, help="untimed steps of each side first (default 5)")
    fid.add_argument("--steps", type=int, default=3, help="steps traced by the capture (default 3)")
    fid.add_argument("--baseline-steps", type=int, default=20, help="plain timed steps in the capture (default 20)")
    fid.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. workload=llama")
    fid.set_defaults(handler=_fidelity)


def _add_zoo(commands: argparse._SubParsersAction) -> None:
    zoo = commands.add_parser("zoo", help="judge generated benchmarks on the model zoo (transformers, torchvision, "
                                          "timm, TorchRec, ...): one table, Markdown/CSV/JSON and MLflow")
    zoo.add_argument("--programs", default=None, help="comma list of zoo programs (default: all)")
    zoo.add_argument("--judgements", type=int, default=2, help="judgements per program, each a fresh capture in a "
                                                                "process of its own (default 2)")
    zoo.add_argument("--rounds", type=int, default=10, help="interleaved rounds per judgement (default 10)")
    zoo.add_argument("--round-steps", type=int, default=5, help="samples of each side per round (default 5)")
    zoo.add_argument("--budget-s", type=float, default=60.0, help="seconds of rounds per judgement at most (default "
                                                                  "60)")
    zoo.add_argument("--warmup", type=int, default=3, help="untimed steps of each side first (default 3)")
    zoo.add_argument("--steps", type=int, default=3, help="steps traced by each capture (default 3)")
    zoo.add_argument("--baseline-steps", type=int, default=10, help="plain timed steps in each capture (default 10)")
    zoo.add_argument("--timeout-s", type=float, default=1800, help="per program, all its judgements (default "
                                                                       "1800)")
    zoo.add_argument("--out", type=Path, default=None, help="output folder (default <results_dir>/zoo/<time>)")
    zoo.add_argument("overrides", nargs="*", help="results_dir=..., tracking.*")
    zoo.set_defaults(handler=_zoo)


def _add_export(commands: argparse._SubParsersAction) -> None:
    exp = commands.add_parser("export", help="write the execution trace as Chakra protobuf (mlc-chakra)")
    exp.add_argument("bundle", type=Path)
    exp.add_argument("--format", choices=["chakra"], required=True)
    exp.add_argument("--out", type=Path, default=None, help="output folder (default <bundle>/chakra)")
    exp.set_defaults(handler=_export)


def _capture(args: argparse.Namespace) -> int:
    from harness.config import compose_config, to_run_config
    from harness.distributed import shutdown_distributed
    from harness.traces.capture import capture_benchmark

    cfg = to_run_config(compose_config(args.overrides))
    try:
        capture_benchmark(cfg, args.out, steps=args.steps, warmup=args.warmup,  # it says where, cost, next
                          baseline_steps=args.baseline_steps)
    finally:
        shutdown_distributed()
    return EXIT_OK


def _generate(args: argparse.Namespace) -> int:
    from workloads.trace_replay.policy import refused_ops
    from workloads.trace_replay.spec import GenerateOptions, generate_spec, write_spec

    steps = [int(s) for s in args.steps.split(",")] if args.steps else None
    window = None
    if args.window_ms:
        start, _, end = args.window_ms.partition(":")
        window = (float(start), float(end))
    options = GenerateOptions(scope=args.scope, op=args.op, exclude_op=args.exclude_op, steps=steps,
                              window_ms=window, repeat=args.repeat, obfuscate=args.obfuscate)
    spec = generate_spec(args.bundle, options)
    out = args.out or (args.bundle / "spec.json")
    write_spec(spec, out)
    kept = sum(r["selected_ops"] for r in spec["ranks"])
    captured = sum(r["captured_ops"] for r in spec["ranks"])
    print(f"spec {out}: {kept} of {captured} captured ops, {len(spec['ranks'])} rank(s)\n"
          f"replay: cobench run workload=generated workload.spec={out}")
    refused = refused_ops(spec)
    if refused:
        listed = "".join(f"\n  {name}: {why}" for name, why in sorted(refused.items()))
        print(f"warning: the captured program used ops a replay refuses by default:{listed}\n"
              f"a replay of this spec needs workload.trust_spec=true (only for a spec you trust)", file=sys.stderr)
    return EXIT_OK


def _fidelity(args: argparse.Namespace) -> int:
    from harness.config import compose_config, to_run_config
    from harness.distributed import env_dist_info, shutdown_distributed
    from harness.running.runner import STATUS_FINISHED
    from harness.traces.judge import judge_benchmark

    cfg = to_run_config(compose_config(args.overrides))
    try:
        result = judge_benchmark(cfg, rounds=args.rounds, steps_per_round=args.round_steps, warmup=args.warmup,
                                 capture_steps=args.steps, baseline_steps=args.baseline_steps, budget_s=args.budget_s)
    finally:
        shutdown_distributed()
    if not env_dist_info().is_main:
        return EXIT_OK if result.status == STATUS_FINISHED else EXIT_FAILED
    if result.status != STATUS_FINISHED:
        print(f"cobench trace fidelity: {result.status}: {result.error}\n  run folder: {result.run_dir}",
              file=sys.stderr)
        return EXIT_FAILED
    m = result.metrics
    record = json.loads((result.run_dir / "fidelity.json").read_text())
    verdict = "valid" if m["fidelity_valid"] else f"NOT VALID: {record['side_by_side']['invalid_reason']}"
    print(f"{cfg.workload.name}: replay {m['replay_step_ms']:.2f} ms vs source {m['source_step_ms']:.2f} ms per step, "
          f"side by side in one process ({m['judgement_rounds']:.0f} rounds of {args.round_steps} samples of "
          f"{m['judgement_batch_steps']:.0f} step(s), {m['judgement_elapsed_s']:.0f} s of a {args.budget_s:.0f} s "
          f"budget)\n"
          f"  time_error_pct {m['time_error_signed_pct']:+.1f} % (95 % interval {m['time_error_ci_low_pct']:+.1f} … "
          f"{m['time_error_ci_high_pct']:+.1f} %), source round cv {m['source_round_cv_pct']:.1f} %: {verdict}\n"
          f"  op coverage {m['op_coverage_pct']:.1f} %, category distance {m['category_distance']:.3f}, peak tensor "
          f"memory {m['replay_peak_memory_mb']:.1f} vs {m['source_peak_memory_mb']:.1f} MB "
          f"({m['memory_error_pct']:+.1f} %)\n"
          f"  run folder: {result.run_dir} (fidelity.json); MLflow run {result.run_id or '(tracking off)'}")
    return EXIT_OK


def _zoo(args: argparse.Namespace) -> int:
    import time

    from harness.config import compose_config, results_root, to_run_config
    from harness.running.runner import connect_tracker
    from harness.traces.side_by_side import MIN_VALID_ROUNDS, TARGET_HALF_WIDTH_PCT
    from suite.zoo import markdown, run_program, write_tables
    from suite.zoo_programs import ZOO

    cfg = to_run_config(compose_config(args.overrides))
    names = list(ZOO) if not args.programs else [n.strip() for n in args.programs.split(",") if n.strip()]
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        raise ValueError(f"unknown zoo program(s) {', '.join(unknown)}; known: {', '.join(ZOO)}")
    if args.judgements < 1:
        raise ValueError(f"--judgements must be >= 1, got {args.judgements}")
    out = args.out or results_root(cfg) / "zoo" / time.strftime("%Y%m%d-%H%M%S")
    tracker = connect_tracker(cfg)  # before hours of work: a store that cannot be reached is said now
    options = {"judgements": args.judgements, "rounds": args.rounds, "steps_per_round": args.round_steps,
               "warmup": args.warmup, "capture_steps": args.steps, "baseline_steps": args.baseline_steps,
               "budget_s": args.budget_s}
    rows = []
    header = (f"Model zoo: {args.judgements} judgement(s) per program, each a fresh capture in a process of its "
              f"own; at least {args.rounds} rounds of {args.round_steps} samples each side, more until there are "
              f"{MIN_VALID_ROUNDS} and the interval (covering a capture at the judgement's moment too) is within "
              f"±{TARGET_HALF_WIDTH_PCT:g} %, or {args.budget_s:.0f} s are spent")
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} ({ZOO[name].library})", file=sys.stderr, flush=True)
        rows.append(run_program(name, out / name, options, args.timeout_s))
        if rows[-1]["status"] != "judged":
            print(f"  {rows[-1]['status']}: {rows[-1].get('reason', '')}", file=sys.stderr)
        write_tables(rows, out, header)  # what is done survives an interruption
    print(markdown(rows, header))
    run_id = None
    if tracker is not None:
        from suite.zoo import log_to_mlflow

        run_id = log_to_mlflow(rows, out, tracker)
    print(f"tables: {out}/zoo.md, zoo.csv, zoo.json; each program's bundles and log in {out}/<program>/"
          + (f"; MLflow run {run_id}" if run_id else ""))
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    from workloads.trace_replay.chakra import export_chakra

    for path in export_chakra(args.bundle, args.out):
        print(f"chakra: {path}")
    return EXIT_OK


def run(argv: list[str]) -> int:
    """``cobench trace SUBCOMMAND ...`` (errors: :func:`suite.cli.guarded`; a capture or replay that
    fails once running exits 1)."""
    from harness.recording.tracking import TrackingError

    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except TrackingError:
        raise  # the store cannot be reached: bad input, before any run
    except RuntimeError as err:
        raise CommandFailed(str(err)) from err
