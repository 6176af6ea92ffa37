"""The what-if subcommands of ``cobench trace``: their parsers, and each one's call into :mod:`harness.whatif` and
what it prints.

    cobench trace predict BUNDLE [CHANGES] [--calibration FILE] [--target-calibration FILE] [--collectives TABLE]
                          [--sharded-stage FILE] [--gradient-sync FILE | --sync-from table]
                          [--chakra DIR] [--json FILE] [--measure [OVERRIDES]]
    cobench trace calibrate --out FILE [--platform NAME] [--threads N] [--host-allocator steady|system]
    cobench trace measure-pair --out FILE [--steps N] [--warmup W] OVERRIDES --changed CHANGES
    cobench trace predict-validate --out DIR [--rounds R] [--steps K] [--cases layers,batch,ranks] [OVERRIDES]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.cli import EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:  # the what-if engine is imported where it is used
    from harness.whatif.run import BundlePrediction

CLI_MODULE = "suite.cli"  # the cobench command, as predict-validate starts it in fresh processes


def add_predict(commands: argparse._SubParsersAction) -> None:
    """``trace predict``: a bundle's step under changes."""
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
                          "`torchrun -m harness.whatif.stage_probe`; default: timed here under torchrun, kept in the "
                          "bundle's what-if cache)")
    pre.add_argument("--gradient-sync", type=Path, default=None, metavar="FILE",
                     help="world_size=W: what DDP's gradient synchronisation adds to the step, timed at W ranks on "
                          "this prediction's skeleton (`torchrun -m harness.whatif.sync_probe`; default: timed here "
                          "under torchrun, kept in the bundle's what-if cache)")
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
    pre.set_defaults(handler=_predict)


def add_predict_validate(commands: argparse._SubParsersAction) -> None:
    """``trace predict-validate``: the prediction's error, over interleaved rounds."""
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
    val.set_defaults(handler=_predict_validate)


def add_measure_pair(commands: argparse._SubParsersAction) -> None:
    """``trace measure-pair``: two configurations side by side in one process."""
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
    pair.set_defaults(handler=_measure_pair)


def add_calibrate(commands: argparse._SubParsersAction) -> None:
    """``trace calibrate``: this platform's cost-model curves."""
    cal = commands.add_parser("calibrate", help="measure this platform's what-if cost-model curves")
    cal.add_argument("--out", type=Path, required=True)
    cal.add_argument("--platform", default="cpu", help="a name for the platform (default cpu)")
    cal.add_argument("--threads", type=int, default=None, help="intra-op threads (default the current)")
    cal.add_argument("--host-allocator", choices=["steady", "system"], default="steady",
                     help="host memory as the runs to predict have it (platform.host_allocator; default steady)")
    cal.set_defaults(handler=_calibrate)


def _predict(args: argparse.Namespace) -> int:
    from harness.whatif.run import PredictOptions, export_prediction_chakra, predict_bundle
    from harness.whatif.validate import measure_prediction

    options = PredictOptions(args.calibration, args.target_calibration, args.collectives, args.assume_busbw_gbps,
                             args.assume_latency_us, args.sharded_stage, args.gradient_sync, args.sync_from)
    prediction = predict_bundle(args.bundle, args.changes, options)
    _print_prediction(prediction)
    record = prediction.record
    if args.chakra is not None:
        print(f"  chakra (edited graph): {export_prediction_chakra(prediction, args.chakra)}")
    if args.measure is not None:
        record["measured"] = measure_prediction(prediction.graph, list(prediction.changes.items), args.measure,
                                                prediction.result)
    if args.json is not None and os.environ.get("RANK", "0") == "0":
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2))
        print(f"  written: {args.json}")
    return EXIT_OK if args.measure is None or record["measured"]["status"] == "FINISHED" else EXIT_FAILED


def _print_prediction(prediction: BundlePrediction) -> None:
    result, record = prediction.result, prediction.record
    parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(result.breakdown_ms.items(), key=lambda kv: -kv[1]))
    print(f"{prediction.graph.workload or 'trace'} {prediction.changes.describe() or '(as captured)'}: predicted step "
          f"{result.predicted_step_ms:.2f} ms (naive linear scaling {result.naive_step_ms:.2f} ms)\n"
          f"  captured step {result.measured_step_ms:.2f} ms; the unchanged graph replays the traced step at "
          f"{result.unchanged_step_ms:.2f} ms, {record['unchanged_error_pct']:+.1f} % against the plain steps "
          f"timed beside its ops ({record['replay_reference_ms']:.2f} ms)\n"
          f"  breakdown (ms, critical path): {parts}")
    if record["inputs"].get("jagged_buckets"):
        jag = record["inputs"]["jagged_buckets"]["representative_draw"]
        print(f"  length buckets from {jag['changed']['batches']}: the median batch's buckets at batch "
              f"{jag['captured']['batch_size']} and {jag['changed']['batch_size']} replace the traced step's")
    if prediction.allreduce is not None and prediction.world and prediction.world > 1:
        _print_data_parallel(prediction)


def _print_data_parallel(prediction: BundlePrediction) -> None:
    allreduce, world = prediction.allreduce, prediction.world
    dp = prediction.record["inputs"]["data_parallel"]
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


def _predict_validate(args: argparse.Namespace) -> int:
    """Rounds of a capture, then per case its prediction and the base and changed real runs back to back
    (:mod:`harness.whatif.validate`): predicted vs measured ratio to the unchanged configuration, ours and naive
    scaling's error."""
    from harness.whatif.validate import run_validation

    summary = run_validation(args.out, args.overrides, args.cases.split(","), args.rounds, args.steps, args.warmup,
                             args.collectives, CLI_MODULE)
    _print_table(summary["rows"])
    print(f"mean absolute error (medians over {args.rounds} interleaved rounds): ours {summary['mae_pct']:.1f} %, "
          f"naive {summary['naive_mae_pct']:.1f} % ({args.out / 'validation.json'})")
    return EXIT_OK


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'workload':8} {'case':7} {'pred ratio':>10} {'meas ratio (min…max)':>22} {'ours median (min…max)':>24} "
          f"{'naive':>8} {'pred ms':>8} {'meas ms':>8}")
    for r in rows:
        print(f"{r['workload']:8} {r['case']:7} {r['predicted_ratio']:10.3f} {r['measured_ratio']:8.3f} "
              f"({r['measured_ratio_min']:.3f}…{r['measured_ratio_max']:.3f}) {r['prediction_error_pct']:+7.1f} % "
              f"({r['prediction_error_min_pct']:+.1f}…{r['prediction_error_max_pct']:+.1f}) "
              f"{r['naive_error_pct']:+7.1f}% {r['predicted_step_ms']:8.2f} {r['measured_step_ms']:8.2f}")


def _measure_pair(args: argparse.Namespace) -> int:
    from harness.whatif.validate import measure_change

    record = measure_change(args.out, args.overrides, args.changed, args.steps, args.warmup)
    low, high = record["ratio_ci"]
    print(f"base {record['base_ms']:.2f} ms, changed ({' '.join(args.changed)}) {record['changed_ms']:.2f} ms: ratio "
          f"{record['ratio']:.3f} (95 % interval {low:.3f} … {high:.3f}, {record['rounds']} interleaved rounds): "
          f"{args.out}")
    return EXIT_OK


def _calibrate(args: argparse.Namespace) -> int:
    from harness.whatif.run import calibrate_platform

    calibration, host_memory = calibrate_platform(args.out, args.platform, args.threads, args.host_allocator)
    print(f"calibration ({calibration.threads} threads, host memory {host_memory}): {args.out}")
    return EXIT_OK
