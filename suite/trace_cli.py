"""``cobench trace``: capture a trace bundle, generate a benchmark spec from it, export it to Chakra.

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
    torchrun --nproc-per-node W -m suite.cli trace time-stage BUNDLE --out FILE [--passes N] [CHANGES]
    torchrun --nproc-per-node W -m suite.cli trace time-sync SPEC --out FILE [--passes N]
    cobench trace measure-pair --out FILE [--steps N] [--warmup W] OVERRIDES --changed CHANGES
    cobench trace predict-validate --out DIR [--rounds R] [--steps K] [--cases layers,batch,ranks] [OVERRIDES]

Replay is a workload like any other: ``cobench run workload=generated workload.spec=SPEC``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.cli import EXIT_FAILED, EXIT_OK, CommandFailed

if TYPE_CHECKING:  # the what-if modules are imported where they are used
    from workloads.whatif.dataparallel import GradientSyncCost, ShardedStageCost
    from workloads.whatif.graph import Graph
    from workloads.whatif.predict import Prediction

STAGE_PASSES = 100  # the sharded stage's timed passes a launch: 2 ranks on 2 shared cores swing it 2-3x pass to pass
STAGE_LAUNCHES = 3  # launches pooled: where a launch's ranks land on the cores moves its median by ±15 %
SYNC_PASSES = 100  # the DDP skeleton's timed passes a launch, of each variant (with and without DDP)
SYNC_LAUNCHES = 3  # launches pooled, the sync cost their median
SYNC_REUSE = 0.2  # a bundle's sync timing serves a prediction whose step is within this share of the one it timed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cobench trace", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    cap = commands.add_parser("capture", help="run a registered workload under the execution-trace observer")
    cap.add_argument("--out", type=Path, default=None,
                     help="bundle folder (default <results_dir>/traces/<workload>-<time>)")
    cap.add_argument("--steps", type=int, default=3, help="steps traced (default 3)")
    cap.add_argument("--warmup", type=int, default=10, help="plain steps first, not timed (default 10)")
    cap.add_argument("--baseline-steps", type=int, default=50,
                     help="plain timed steps: the reference the replay is judged against (default 50)")
    cap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. workload=llama workload.preset=tiny")

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

    zoo = commands.add_parser("zoo", help="judge generated benchmarks on the model zoo (transformers, torchvision, "
                                          "timm, TorchRec, ...): one table, Markdown/CSV/JSON and MLflow")
    zoo.add_argument("--programs", default=None, help="comma list of zoo programs (default: all)")
    zoo.add_argument("--judgements", type=int, default=2, help="judgements per program, each from a fresh capture "
                                                                "(default 2)")
    zoo.add_argument("--rounds", type=int, default=10, help="interleaved rounds per judgement (default 10)")
    zoo.add_argument("--round-steps", type=int, default=5, help="samples of each side per round (default 5)")
    zoo.add_argument("--budget-s", type=float, default=60.0, help="seconds of rounds per judgement at most (default "
                                                                  "60)")
    zoo.add_argument("--warmup", type=int, default=3, help="untimed steps of each side first (default 3)")
    zoo.add_argument("--steps", type=int, default=3, help="steps traced by each capture (default 3)")
    zoo.add_argument("--baseline-steps", type=int, default=10, help="plain timed steps in each capture (default 10)")
    zoo.add_argument("--timeout-s", type=float, default=1800, help="per program (default 1800)")
    zoo.add_argument("--out", type=Path, default=None, help="output folder (default <results_dir>/zoo/<time>)")
    zoo.add_argument("overrides", nargs="*", help="results_dir=..., tracking.*")

    pre = commands.add_parser("predict", help="what-if: the captured step's time under changed settings, from "
                                               "the trace's graph and calibrated cost models (no model runs)")
    pre.add_argument("bundle", type=Path)
    pre.add_argument("changes", nargs="*", help="workload.<layers key>=N (n_layers, num_layers, dcn_num_layers), "
                                                "workload.batch_size=B, workload.seq_len=S (seqrec: max_len), "
                                                "world_size=W (data-parallel ranks)")
    pre.add_argument("--calibration", type=Path, default=None,
                     help="this platform's cost-model curves (default: in the bundle's what-if cache, measured "
                          "there first)")
    pre.add_argument("--target-calibration", type=Path, default=None,
                     help="another platform's curves (made there with `cobench trace calibrate`): predict for it")
    pre.add_argument("--json", type=Path, default=None, help="write the prediction as JSON")
    pre.add_argument("--collectives", type=Path, default=None,
                     help="the collectives benchmark's sweep table (all_reduce at the new world size): the "
                          "gradient all-reduce's time; without it an assumed bandwidth, stated in the output")
    pre.add_argument("--assume-busbw-gbps", type=float, default=1.0,
                     help="bus bandwidth assumed without --collectives (default 1.0 GB/s)")
    pre.add_argument("--assume-latency-us", type=float, default=50.0,
                     help="all-reduce latency assumed without --collectives (default 50 µs)")
    pre.add_argument("--sharded-stage", type=Path, default=None, metavar="FILE",
                     help="TorchRec workloads at world_size=W: the sharded stage's timing at W ranks (made with "
                          "`trace time-stage`; default: timed here under torchrun, kept in the bundle)")
    pre.add_argument("--gradient-sync", type=Path, default=None, metavar="FILE",
                     help="world_size=W: what DDP's gradient synchronisation adds to the step, timed at W ranks on "
                          "this prediction's skeleton (`trace time-sync`; default: timed here under torchrun, kept "
                          "in the bundle)")
    pre.add_argument("--sync-from", choices=["skeleton", "table"], default="skeleton",
                     help="world_size=W: DDP's synchronisation measured on a skeleton of the step (default), or "
                          "only the gradients' all-reduce after backward, from --collectives or the assumption "
                          "(no torchrun launches; what is left for a platform the skeleton cannot run on)")
    pre.add_argument("--chakra", type=Path, default=None, metavar="DIR",
                     help="also write the edited graph as a Chakra execution trace (DIR/rank0.et)")
    pre.add_argument("--measure", nargs="*", default=None, metavar="OVERRIDE",
                     help="then run the changed configuration for real (a cobench run; overrides such as "
                          "runner.steps=60 tracking=off results_dir=DIR apply to it) and log prediction_error_pct "
                          "with it")

    val = commands.add_parser("predict-validate", help="per round: capture a workload, predict 2x layers, 2x batch and "
                                                       "1 -> 2 ranks from it, run each with the unchanged "
                                                       "configuration back to back: the what-if error table")
    val.add_argument("--out", type=Path, required=True,
                     help="folder for the bundles (bundle-<round>), predictions, runs and table")
    val.add_argument("--rounds", type=int, default=5,
                     help="rounds (a capture, then per case its prediction, a base run, a changed run; default 5)")
    val.add_argument("--steps", type=int, default=100,
                     help="timed steps of each short run (default 100: a 2-rank run on a shared host swings its "
                          "step by ±40 %% step to step; over 20 steps its median moved ±25 %% run to run)")
    val.add_argument("--warmup", type=int, default=5, help="untimed steps of each short run first (default 5)")
    val.add_argument("--cases", default="layers,batch,ranks", help="comma list of layers, batch, ranks (default all)")
    val.add_argument("--collectives", type=Path, default=None,
                     help="the all_reduce sweep table at 2 ranks for the ranks case (else the stated assumption)")
    val.add_argument("overrides", nargs="*", help="the workload, e.g. workload=dlrm workload.preset=tiny; "
                                                  "tracking.* and results_dir: where each case's MLflow run goes")

    pair = commands.add_parser("measure-pair", help="two configurations of a workload side by side in one process, "
                                                    "their steps interleaved in rounds: step medians and the ratio "
                                                    "with its 95 %% interval (predict-validate's measurement)")
    pair.add_argument("--out", type=Path, required=True, help="the record (JSON)")
    pair.add_argument("--steps", type=int, default=100,
                      help="timed steps of each side (default 100; whole rounds of 10, at least 2)")
    pair.add_argument("--warmup", type=int, default=5, help="untimed steps of each side first (default 5)")
    pair.add_argument("overrides", nargs="*", help="the base configuration, e.g. workload=llama")
    pair.add_argument("--changed", nargs="+", required=True, metavar="OVERRIDE",
                      help="what the changed side overrides on top of the base, e.g. workload.batch_size=16")

    stg = commands.add_parser("time-stage", help="under torchrun: time a TorchRec workload's sharded embedding "
                                                  "stage alone at this world size (what `predict world_size=W` "
                                                  "needs of it)")
    stg.add_argument("bundle", type=Path, help="the single-rank capture whose workload and config are timed")
    stg.add_argument("--out", type=Path, required=True, help="the timing (JSON), for predict --sharded-stage")
    stg.add_argument("--passes", type=int, default=STAGE_PASSES, help=f"timed passes (default {STAGE_PASSES})")
    stg.add_argument("--warmup", type=int, default=10, help="untimed passes first (default 10)")
    stg.add_argument("changes", nargs="*", help="workload.* changes the prediction makes (e.g. workload.batch_size=B)")

    syn = commands.add_parser("time-sync", help="under torchrun: time what DDP's gradient synchronisation adds to a "
                                                 "predicted step at this world size (on the skeleton `predict "
                                                 "world_size=W` writes)")
    syn.add_argument("spec", type=Path, help="the skeleton: a prediction's JSON (predict --json) or its sync_spec")
    syn.add_argument("--out", type=Path, required=True, help="the timing (JSON), for predict --gradient-sync")
    syn.add_argument("--passes", type=int, default=SYNC_PASSES,
                     help=f"timed passes of each variant (default {SYNC_PASSES})")
    syn.add_argument("--warmup", type=int, default=10, help="untimed passes of each variant first (default 10)")

    cal = commands.add_parser("calibrate", help="measure this platform's what-if cost-model curves")
    cal.add_argument("--out", type=Path, required=True)
    cal.add_argument("--platform", default="cpu", help="a name for the platform (default cpu)")
    cal.add_argument("--threads", type=int, default=None, help="intra-op threads (default the current)")
    cal.add_argument("--host-allocator", choices=["steady", "system"], default="steady",
                     help="host memory as the runs to predict have it (platform.host_allocator; default steady)")

    exp = commands.add_parser("export", help="write the execution trace as Chakra protobuf (mlc-chakra)")
    exp.add_argument("bundle", type=Path)
    exp.add_argument("--format", choices=["chakra"], required=True)
    exp.add_argument("--out", type=Path, default=None, help="output folder (default <bundle>/chakra)")
    return parser


def _capture(args: argparse.Namespace) -> int:
    from harness.capture import capture_benchmark
    from harness.config import compose_config, to_run_config
    from harness.distributed import shutdown_distributed

    cfg = to_run_config(compose_config(args.overrides))
    try:
        capture_benchmark(cfg, args.out, steps=args.steps, warmup=args.warmup,  # it says where, cost, next
                          baseline_steps=args.baseline_steps)
    finally:
        shutdown_distributed()
    return EXIT_OK


def _generate(args: argparse.Namespace) -> int:
    from workloads.trace_replay.safety import refused_ops
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
    from harness.judge import judge_benchmark
    from harness.runner import STATUS_FINISHED

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
    from harness.runner import connect_tracker
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
    header = (f"Model zoo: {args.judgements} judgement(s) per program, each from a fresh capture; at least "
              f"{args.rounds} rounds of {args.round_steps} samples each side, more until the interval is within "
              f"±2.5 % or {args.budget_s:.0f} s are spent")
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


def _predict(args: argparse.Namespace) -> int:
    from harness.platform import configure_host_allocator, host_allocator_in_effect
    from workloads.whatif.cache import cache_dir
    from workloads.whatif.chakra_export import edited_ops, export_edited_chakra
    from workloads.whatif.changes import parse_changes
    from workloads.whatif.costmodel import calibrate, load_or_calibrate, read_calibration
    from workloads.whatif.dataparallel import (
        allreduce_cost,
        bucket_sizes,
        predict_data_parallel,
        rank_change,
        stage_ops,
        threads_per_rank,
    )
    from workloads.whatif.graph import load_graph
    from workloads.whatif.predict import predict

    graph = load_graph(args.bundle)
    parsed = parse_changes(graph, args.changes)
    change, world = parsed.change, parsed.world_size
    # the curves are measured with host memory as the capture had it (a step's ops and the curves' alike pay
    # for glibc returning freed memory, or neither does)
    configure_host_allocator("steady" if graph.platform.get("host_allocator", "").startswith("steady") else "system")
    calibration = load_or_calibrate(args.calibration or cache_dir(args.bundle) / "calibration.json")
    if args.target_calibration is not None:
        if not args.target_calibration.exists():
            raise ValueError(f"--target-calibration {args.target_calibration} does not exist: make it on the "
                             "target with `cobench trace calibrate --out FILE`")
        change.calibration = read_calibration(args.target_calibration)
    if args.collectives is not None and not args.collectives.exists():
        raise ValueError(f"--collectives {args.collectives} does not exist: it is the collectives benchmark's "
                         "sweep table (collectives_all_reduce.json in that run's folder)")
    allreduce, rank_calibration = None, None
    if world is not None:
        allreduce = allreduce_cost(world, args.collectives, args.assume_busbw_gbps, args.assume_latency_us)
        threads, rank_threads = threads_per_rank(graph, world)
        if rank_threads != threads and change.calibration is None:  # ranks share the host's cores
            cached = cache_dir(args.bundle) / f"calibration_{rank_threads}threads.json"
            rank_calibration = load_or_calibrate(cached, f"{calibration.platform}-{rank_threads}threads",
                                                 rank_threads) if args.calibration is None else \
                calibrate(f"{calibration.platform}-{rank_threads}threads", rank_threads)
        sharded = _has_sharded_stage(graph.workload)
        stage = _stage_cost(args, graph, world, parsed.items, change.calibration is not None) \
            if sharded and world > 1 else None
        result = predict_data_parallel(graph, world, calibration, change, rank_calibration, allreduce, stage,
                                       sharded)
        sync = _sync_cost(args, result.inputs["data_parallel"].get("sync_spec"), world, change.calibration is not None)
        if sync is not None:
            result = predict_data_parallel(graph, world, calibration, change, rank_calibration, allreduce, stage,
                                           sharded, sync)
    else:
        result = predict(graph, change, calibration)
    record = result.to_json()
    record["inputs"]["changes"] = list(parsed.items)
    record["inputs"]["host_allocator"] = host_allocator_in_effect()  # the curves' (the capture's, see above)
    parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(result.breakdown_ms.items(), key=lambda kv: -kv[1]))
    print(f"{graph.workload or 'trace'} {parsed.describe() or '(as captured)'}: predicted step "
          f"{result.predicted_step_ms:.2f} ms (naive linear scaling {result.naive_step_ms:.2f} ms)\n"
          f"  captured step {result.measured_step_ms:.2f} ms; the unchanged graph replays the traced step at "
          f"{result.unchanged_step_ms:.2f} ms, {record['unchanged_error_pct']:+.1f} % against the plain steps "
          f"timed beside its ops ({record['replay_reference_ms']:.2f} ms)\n"
          f"  breakdown (ms, critical path): {parts}")
    if record["inputs"].get("jagged_buckets"):
        jag = record["inputs"]["jagged_buckets"]["representative_draw"]
        print(f"  length buckets from {jag['changed']['batches']}: the median batch's buckets at batch "
              f"{jag['captured']['batch_size']} and {jag['changed']['batch_size']} replace the traced step's")
    if allreduce is not None and world and world > 1:
        dp = record["inputs"]["data_parallel"]
        how = "measured sweep table " + allreduce.source if allreduce.sizes else \
            f"ASSUMED bus bandwidth {allreduce.busbw_gbps} GB/s and latency {allreduce.latency_us} µs (pass " \
            "--collectives TABLE for measured ones)"
        print(f"  {world} data-parallel ranks: batch {dp['batch_per_rank']} a rank, {dp['threads_per_rank']} "
              f"intra-op thread(s) a rank, {dp['gradient_bytes'] / 1e6:.2f} MB of gradients in DDP")
        if dp.get("gradient_sync"):
            timing = dp["gradient_sync"]["timing"]
            print(f"  DDP's gradient synchronisation: +{dp['gradient_sync_ms']:.2f} ms, measured at {world} ranks on a "
                  f"skeleton of this step ({timing['gradients']} gradients at their predicted times; launches "
                  f"{', '.join(f'{x:+.2f}' for x in timing.get('launch_sync_ms', [timing['sync_ms']]))} ms; "
                  f"{dp['gradient_sync']['source']})")
        else:
            print(f"  DDP's gradient all-reduce: {dp['allreduce_ms']:.2f} ms in {dp['buckets']} bucket(s) after "
                  f"backward, from {how}; DDP's synchronisation beyond the collective is not modelled (--sync-from "
                  "skeleton measures it)")
        if dp.get("sharded_stage"):
            st = dp["sharded_stage"]
            print(f"  sharded embedding stage ({st['module']}: {st['ops_replaced']} ops of the capture replaced): "
                  f"{st['measured_ms']:.2f} ms, timed alone at {world} ranks (p10 {st['timing']['ms_p10']:.2f}, p90 "
                  f"{st['timing']['ms_p90']:.2f} over {st['timing']['passes']} passes; {st['source']})")
        if dp.get("not_modelled"):
            print(f"  warning: not modelled: {dp['not_modelled']}")
    if args.chakra is not None:  # the edited graph one rank runs (layers already assigned by the prediction)
        local = rank_change(graph, world, change, rank_calibration) if world and world > 1 else change
        dp = record["inputs"].get("data_parallel", {})
        buckets = [(b, allreduce.at(b)) for b in bucket_sizes(dp["gradient_bytes"])] \
            if world and world > 1 and allreduce is not None else []
        if buckets and dp.get("gradient_sync_ms") is not None:  # the measured sync, shared out by the buckets' times
            total = sum(us for _, us in buckets) or 1.0
            buckets = [(b, 1e3 * dp["gradient_sync_ms"] * us / total) for b, us in buckets]
        st = record["inputs"].get("data_parallel", {}).get("sharded_stage")
        path = export_edited_chakra(graph, edited_ops(graph, local, calibration), args.chakra / "rank0.et", buckets,
                                    (stage_ops(graph, st["module"]), 1e3 * st["measured_ms"]) if st else None)
        record["chakra"] = str(path)
        print(f"  chakra (edited graph): {path}")
    if args.measure is not None:
        record["measured"] = _measure_prediction(graph, list(parsed.items), args.measure, result)
    if args.json is not None and os.environ.get("RANK", "0") == "0":
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2))
        print(f"  written: {args.json}")
    return EXIT_OK if args.measure is None or record["measured"]["status"] == "FINISHED" else EXIT_FAILED


def _has_sharded_stage(workload: str) -> bool:
    """Whether the registered workload has a TorchRec sharded stage (it implements ``sharded_stage``)."""
    from workloads import discover
    from workloads.base import WorkloadBase

    spec = discover().get(workload)
    if spec is None:
        return False
    return getattr(spec.factory, "sharded_stage", WorkloadBase.sharded_stage) is not WorkloadBase.sharded_stage


def _stage_cost(args: argparse.Namespace, graph: Graph, world: int, changes: list[str],
                other_platform: bool) -> ShardedStageCost:
    """The sharded stage's time at ``world`` ranks: ``--sharded-stage``, else the bundle's timing for these
    changes, else timed now (``trace time-stage`` under torchrun on this host, launches pooled; in this process
    group when this command already runs under torchrun at that world size)."""

    from harness.stage_probe import pooled
    from workloads.whatif.cache import cache_dir
    from workloads.whatif.dataparallel import ShardedStageCost

    stage_changes = sorted(c for c in changes if c.startswith("workload."))
    if args.sharded_stage is not None:
        if not args.sharded_stage.exists():
            raise ValueError(f"--sharded-stage {args.sharded_stage} does not exist: time the stage with `torchrun "
                             f"--nproc-per-node {world} -m suite.cli trace time-stage BUNDLE --out FILE`")
        record = read_json_file(args.sharded_stage)
        if sorted(record.get("changes") or []) != stage_changes:
            raise ValueError(f"--sharded-stage {args.sharded_stage} was timed with changes {record.get('changes')}, "
                             f"this prediction makes {stage_changes}: time it with the same workload.* changes")
        return ShardedStageCost.from_timing(record, str(args.sharded_stage))
    if other_platform:
        raise ValueError(f"predicting {graph.workload} at world_size={world} for another platform needs its sharded "
                         f"stage timed there: `torchrun --nproc-per-node {world} -m suite.cli trace time-stage BUNDLE "
                         "--out FILE` on the target, then --sharded-stage FILE")
    cached = cache_dir(args.bundle) / f"sharded_stage_{world}ranks{_changes_key(stage_changes)}.json"
    if not cached.exists():
        if int(os.environ.get("WORLD_SIZE", "1")) == world:  # already W ranks (predict --measure under torchrun):
            # every rank times it together and gets the same record (rank 0 also keeps it in the bundle)
            record = _time_stage(args.bundle, cached, STAGE_LAUNCHES * STAGE_PASSES, 10, stage_changes)
            return ShardedStageCost.from_timing(record, str(cached))
        print(f"  timing {graph.workload}'s sharded embedding stage at {world} ranks ({STAGE_LAUNCHES} torchrun "
              f"launches of {STAGE_PASSES} passes) ...", flush=True)
        _launch_pooled(world, ["time-stage", str(args.bundle), *stage_changes], cached, STAGE_LAUNCHES, pooled,
                       "the sharded stage")
    return ShardedStageCost.from_timing(read_json_file(cached), str(cached))


def _launch_pooled(world: int, command: list[str], cached: Path, launches: int,
                   pool: Callable[[list[dict[str, Any]]], dict[str, Any]], what: str) -> None:
    """``launches`` torchrun launches at ``world`` ranks of ``cobench trace <command> --out PART``, their records
    pooled (``pool``) into ``cached``: a launch's placement of ranks on a shared host's cores moves its figure."""
    import subprocess

    records = []
    for i in range(launches):
        part = cached.with_suffix(f".launch{i}.json")
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "-m",
                               "suite.cli", "trace", *command, "--out", str(part)], capture_output=True, text=True)
        if done.returncode != 0 or not part.exists():
            raise RuntimeError(f"timing {what} at {world} ranks failed (exit {done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[-2000:]}")
        records.append(read_json_file(part))
        part.unlink()
    cached.write_text(json.dumps(pool(records), indent=1))


def _changes_key(changes: list[str]) -> str:
    """A bundle file's suffix for a prediction's workload.* changes ("" for none): a timing kept per change."""
    key = "-".join(c.removeprefix("workload.").replace("=", "") for c in sorted(changes) if c.startswith("workload."))
    return f"_{key}" if key else ""


def _sync_cost(args: argparse.Namespace, spec: dict | None, world: int,
               other_platform: bool) -> GradientSyncCost | None:
    """DDP's gradient synchronisation at ``world`` ranks for this prediction's skeleton ``spec``:
    ``--gradient-sync``, else the bundle's timing of a skeleton of these changes (the same gradients, its step
    within :data:`SYNC_REUSE`), else timed now (``trace time-sync`` under
    torchrun on this host, launches pooled; in this process group when this command already runs at that
    world size). None: ``--sync-from table``, one rank, or another platform without a timing made there."""

    from harness.sync_probe import pooled
    from workloads.whatif.cache import cache_dir
    from workloads.whatif.dataparallel import GradientSyncCost

    if spec is None or world < 2:
        return None
    if args.gradient_sync is not None:
        if not args.gradient_sync.exists():
            raise ValueError(f"--gradient-sync {args.gradient_sync} does not exist: time the skeleton with `torchrun "
                             f"--nproc-per-node {world} -m suite.cli trace time-sync PREDICTION.json --out FILE`")
        return GradientSyncCost.from_timing(read_json_file(args.gradient_sync), str(args.gradient_sync))
    if args.sync_from == "table":
        return None
    if other_platform:
        print("  note: DDP's synchronisation on another platform is timed there: `torchrun --nproc-per-node "
              f"{world} -m suite.cli trace time-sync PREDICTION.json --out FILE` on the target (PREDICTION.json: "
              "this command's --json), then --gradient-sync FILE; until then the all-reduce alone is counted")
        return None
    cached = cache_dir(args.bundle) / f"gradient_sync_{world}ranks{_changes_key(args.changes)}.json"
    if cached.exists():
        record = read_json_file(cached)
        if record.get("gradients") != len(spec["gradients"]) or "job_ddp_ms_p50" not in record or \
                abs(float(record.get("spec_step_ms", 0.0)) / spec["step_ms"] - 1.0) > SYNC_REUSE:
            # a skeleton of another step (other curves, another stage timing), or a timing of each rank's own
            # median (an earlier cobench): time this one
            cached.unlink()
    spec_file = cached.with_suffix(".spec.json")
    if not cached.exists():
        if int(os.environ.get("WORLD_SIZE", "1")) == world:  # already W ranks: time it in this process group
            record = _time_sync(spec, cached, SYNC_LAUNCHES * SYNC_PASSES, 10)
            return GradientSyncCost.from_timing(record | {"launch_sync_ms": [record["sync_ms"]]}, str(cached))
        print(f"  timing DDP's gradient synchronisation at {world} ranks on a skeleton of this step ({SYNC_LAUNCHES} "
              f"torchrun launches of {SYNC_PASSES} passes) ...", flush=True)
        spec_file.write_text(json.dumps(spec))
        _launch_pooled(world, ["time-sync", str(spec_file)], cached, SYNC_LAUNCHES, pooled, "DDP's gradient sync")
    return GradientSyncCost.from_timing(read_json_file(cached), str(cached))


def read_json_file(path: Path) -> dict:
    """A JSON object from ``path``, or a ValueError naming the file."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not readable as JSON ({err})") from err
    if not isinstance(record, dict):
        raise ValueError(f"{path}: not a JSON object")
    return record


def _time_stage(bundle: Path, out: Path, passes: int, warmup: int, changes: list[str]) -> dict:
    """Time the bundle's workload's sharded stage in this process group; rank 0 writes ``out``."""
    from omegaconf import OmegaConf

    from harness.config import compose_config, to_run_config
    from harness.stage_probe import time_sharded_stage
    from workloads.whatif.cache import cache_dir
    from workloads.whatif.graph import load_graph

    graph = load_graph(bundle)
    bad = [c for c in changes if not c.startswith("workload.") or "=" not in c]
    if bad:
        raise ValueError(f"time-stage takes workload.KEY=VALUE changes only, got {bad[0]!r}")
    overrides = OmegaConf.to_container(OmegaConf.from_dotlist([c.removeprefix("workload.") for c in changes]))
    workload = graph.workload_config(overrides)
    if workload is None:
        raise ValueError(f"{bundle}: its workload {graph.workload!r} cannot be built by this version of cobench "
                         "(or the changes do not fit its config)")
    cfg = to_run_config(compose_config([f"workload={graph.workload}", "tracking=off",
                                        f"seed={graph.config.get('seed', 1234)}"]))
    cfg.workload = workload
    timing = time_sharded_stage(cfg, cache_dir(bundle) / "stage_probe", passes, warmup).to_json()
    timing["changes"] = changes
    if os.environ.get("RANK", "0") == "0":
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(timing, indent=1))
    return timing


def _time_stage_command(args: argparse.Namespace) -> int:
    from harness.distributed import shutdown_distributed

    try:
        timing = _time_stage(args.bundle, args.out, args.passes, args.warmup, args.changes)
    finally:
        shutdown_distributed()
    if os.environ.get("RANK", "0") == "0":
        print(f"{timing['workload']} sharded stage ({timing['module']}) at {timing['world_size']} rank(s): "
              f"{timing['ms_p50']:.2f} ms a pass (p10 {timing['ms_p10']:.2f}, p90 {timing['ms_p90']:.2f}, "
              f"{timing['passes']} passes): {args.out}")
    return EXIT_OK


def read_sync_spec(path: Path) -> dict:
    """A DDP skeleton's spec from ``path``: a prediction's JSON (its ``inputs.data_parallel.sync_spec``) or the
    spec itself."""
    record = read_json_file(path)
    spec = (record.get("inputs") or {}).get("data_parallel", {}).get("sync_spec") if "inputs" in record else record
    if not isinstance(spec, dict) or not {"gradients", "ready_ms", "step_ms", "world_size"} <= set(spec):
        raise ValueError(f"{path}: neither a prediction at world_size>1 (predict --json) nor its sync_spec")
    return spec


def _time_sync(spec: dict, out: Path, passes: int, warmup: int) -> dict:
    """Time the skeleton in this process group (its world size must be the spec's); rank 0 writes ``out``."""
    from harness.config import compose_config, to_run_config
    from harness.distributed import env_dist_info
    from harness.runner import join
    from harness.sync_probe import time_gradient_sync

    world = env_dist_info().world_size
    if world != int(spec["world_size"]):
        raise ValueError(f"the skeleton is of a step at {spec['world_size']} ranks, this runs {world}: launch it "
                         f"with torchrun --nproc-per-node {spec['world_size']} -m suite.cli trace time-sync ...")
    if world < 2:
        raise ValueError("time-sync needs 2 or more ranks: launch it with torchrun --nproc-per-node W")
    platform, _ = join(to_run_config(compose_config(["tracking=off"])))  # this rank's device, in the process group
    timing = time_gradient_sync(spec, platform.device, passes, warmup).to_json()
    if os.environ.get("RANK", "0") == "0":
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(timing, indent=1))
    return timing


def _time_sync_command(args: argparse.Namespace) -> int:
    from harness.distributed import shutdown_distributed

    spec = read_sync_spec(args.spec)
    try:
        timing = _time_sync(spec, args.out, args.passes, args.warmup)
    finally:
        shutdown_distributed()
    if os.environ.get("RANK", "0") == "0":
        print(f"DDP gradient sync at {timing['world_size']} ranks ({timing['gradients']} gradients, "
              f"{timing['gradient_bytes'] / 1e6:.2f} MB): +{timing['sync_ms']:.2f} ms a step (skeleton "
              f"{statistics.median(timing['plain_ms_p50']):.2f} ms without DDP, "
              f"{statistics.median(timing['ddp_ms_p50']):.2f} with; {timing['passes']} passes each): {args.out}")
    return EXIT_OK


def _measure_prediction(graph: Graph, changes: list[str], overrides: list[str], prediction: Prediction) -> dict:
    """Run the changed configuration for real (the captured workload config, the changes, ``overrides``)
    and log the prediction's error with it: ``prediction_error_pct`` and naive scaling's beside it."""
    from omegaconf import OmegaConf

    from harness.config import compose_config, to_run_config
    from harness.runner import run_benchmark
    from workloads.whatif.changes import WORLD_KEYS

    world = next((int(c.partition("=")[2]) for c in changes if c.partition("=")[0] in WORLD_KEYS), 1)
    running = int(os.environ.get("WORLD_SIZE", "1"))
    if world != running:
        raise ValueError(f"--measure of world_size={world} needs {world} processes, this one runs {running}: "
                         f"launch it with torchrun --nproc-per-node {world} -m suite.cli trace predict ...")
    changes = [c for c in changes if c.partition("=")[0] not in WORLD_KEYS]
    workload = {k: v for k, v in (graph.config.get("workload") or {}).items() if v is not None}
    composed = compose_config([f"workload={workload['name']}", *overrides])
    cfg = to_run_config(OmegaConf.merge(composed, {"workload": workload}, OmegaConf.from_dotlist(changes)))

    def errors(metrics: dict[str, float]) -> dict[str, float]:
        measured = metrics.get("step_time_ms_p50")
        if not measured:
            return {}
        return {"predicted_step_ms": prediction.predicted_step_ms, "naive_step_ms": prediction.naive_step_ms,
                "prediction_error_pct": 100.0 * (prediction.predicted_step_ms / measured - 1.0),
                "naive_error_pct": 100.0 * (prediction.naive_step_ms / measured - 1.0)}

    result = run_benchmark(cfg, benchmark=f"whatif-{cfg.workload.name}", derived=errors)
    figures = errors(result.metrics)
    if figures:
        print(f"  measured: step p50 {result.metrics['step_time_ms_p50']:.2f} ms → prediction error "
              f"{figures['prediction_error_pct']:+.1f} % (naive {figures['naive_error_pct']:+.1f} %); "
              f"MLflow run {result.run_id or '(tracking off)'}")
    else:
        print(f"  measured: the run ended {result.status}: {result.error}")
    return {"status": result.status, "run_id": result.run_id,
            "step_time_ms_p50": result.metrics.get("step_time_ms_p50"),
            "step_time_cv": result.metrics.get("step_time_cv"), "throughput_cv": result.metrics.get("throughput_cv"),
            "repetitions": result.metrics.get("repetitions_completed"), **figures}


def _predict_validate(args: argparse.Namespace) -> int:
    """Rounds of a capture, then per case its prediction and the base and changed real runs back to back
    (:mod:`suite.whatif_validate`): predicted vs measured ratio to the unchanged configuration, ours and naive
    scaling's error."""
    import statistics

    from suite.whatif_validate import log_cases, print_table, validate

    if args.rounds < 1 or args.steps < 1:
        raise ValueError("--rounds and --steps must be at least 1")
    results = validate(args.out, args.overrides, args.cases.split(","), args.rounds, args.steps, args.warmup,
                       args.collectives)
    rows = [r.summary() for r in results]
    summary = {"rows": rows, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
               "mae_pct": statistics.fmean(abs(r["prediction_error_pct"]) for r in rows),
               "naive_mae_pct": statistics.fmean(abs(r["naive_error_pct"]) for r in rows)}
    (args.out / "validation.json").write_text(json.dumps(summary, indent=2))  # kept should logging fail
    run_ids = log_cases(results, args.overrides)
    for row in rows:
        row["run_id"] = run_ids.get(row["case"])
    (args.out / "validation.json").write_text(json.dumps(summary, indent=2))
    print_table(rows)
    print(f"mean absolute error (medians over {args.rounds} interleaved rounds): ours {summary['mae_pct']:.1f} %, "
          f"naive {summary['naive_mae_pct']:.1f} % ({args.out / 'validation.json'})")
    return EXIT_OK


def _measure_pair(args: argparse.Namespace) -> int:
    from suite.whatif_validate import measure_pair

    if args.steps < 1 or args.warmup < 0:
        raise ValueError("--steps must be at least 1 and --warmup at least 0")
    from workloads.whatif.changes import WORLD_KEYS

    if any(c.partition("=")[0] in WORLD_KEYS for c in args.changed):
        raise ValueError("measure-pair runs both sides in one process: a world-size change needs its own launch")
    record = measure_pair(args.overrides, [*args.overrides, *args.changed], args.out.parent / f"{args.out.stem}-work",
                          args.steps, args.warmup)
    record["changed"] = args.changed
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    low, high = record["ratio_ci"]
    print(f"base {record['base_ms']:.2f} ms, changed ({' '.join(args.changed)}) {record['changed_ms']:.2f} ms: ratio "
          f"{record['ratio']:.3f} (95 % interval {low:.3f} … {high:.3f}, {record['rounds']} interleaved rounds): "
          f"{args.out}")
    return EXIT_OK


def _calibrate(args: argparse.Namespace) -> int:
    from harness.platform import configure_host_allocator, host_allocator_in_effect
    from workloads.whatif.costmodel import calibrate

    configure_host_allocator(args.host_allocator)
    calibration = calibrate(args.platform, args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(calibration.to_json() | {"host_allocator": host_allocator_in_effect()}, indent=1))
    print(f"calibration ({calibration.threads} threads, host memory {host_allocator_in_effect()}): {args.out}")
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    from workloads.trace_replay.chakra import export_chakra

    for path in export_chakra(args.bundle, args.out):
        print(f"chakra: {path}")
    return EXIT_OK


def run(argv: list[str]) -> int:
    """``cobench trace SUBCOMMAND ...`` (errors: :func:`suite.cli.guarded`; a capture or replay that
    fails once running exits 1)."""
    from harness.tracking import TrackingError

    args = _parser().parse_args(argv)
    handlers = {"capture": _capture, "generate": _generate, "fidelity": _fidelity, "export": _export, "zoo": _zoo,
                "predict": _predict, "calibrate": _calibrate, "predict-validate": _predict_validate,
                "time-stage": _time_stage_command, "time-sync": _time_sync_command, "measure-pair": _measure_pair}
    try:
        return handlers[args.command](args)
    except TrackingError:
        raise  # the store cannot be reached: bad input, before any run
    except RuntimeError as err:
        raise CommandFailed(str(err)) from err
