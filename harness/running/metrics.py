"""From what each rank measured to the metric names shared by every workload (DESIGN.md).

Per repetition, the global throughput is all ranks' work over the slowest rank's time (a
synchronous step is as slow as its slowest rank). Across repetitions, the headline figure is
the olympic mean, with the coefficient of variation beside it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from harness.running.loop import RepetitionState
from harness.running.timing import coefficient_of_variation, olympic_mean, step_stats


@dataclass(frozen=True)
class RepetitionSummary:
    throughput: float  # global units per second
    samples_per_s: float
    step_time_ms_p50: float
    step_time_ms_p90: float
    step_time_ms_p99: float
    step_time_ms_mean: float
    step_time_cv: float
    achieved_flops: float | None  # global FLOP/s
    peak_memory_mb: float
    rank_step_time_ms_p50: list[float]
    data_wait_ms_p50: float | None  # the slowest rank's median wait for a batch; None: not measured


def summarise_repetition(per_rank: list[RepetitionState], throughput_unit: str) -> RepetitionSummary | None:
    """Combine one repetition's ranks; None if no timed step finished."""
    if any(not state.step_times_s for state in per_rank):
        return None
    stats = [step_stats(state.step_times_s) for state in per_rank]
    slowest_s = max(s.total_s for s in stats)
    samples = sum(state.timed_samples for state in per_rank)
    tokens = sum(state.timed_tokens for state in per_rank)
    units = tokens if throughput_unit == "tokens/s" else samples
    # Percentiles of the step as the job sees it: the slowest rank at each step.
    job_steps = [max(times) for times in zip(*(state.step_times_s for state in per_rank), strict=False)]
    job = step_stats(job_steps)
    flops = None
    if all(state.flops_per_step is not None for state in per_rank):
        total_flops = sum(state.flops_per_step * len(state.step_times_s) for state in per_rank)
        flops = total_flops / slowest_s
    return RepetitionSummary(
        throughput=units / slowest_s,
        samples_per_s=samples / slowest_s,
        step_time_ms_p50=job.p50_ms,
        step_time_ms_p90=job.p90_ms,
        step_time_ms_p99=job.p99_ms,
        step_time_ms_mean=job.mean_ms,
        step_time_cv=job.cv,
        achieved_flops=flops,
        peak_memory_mb=max(state.peak_memory_bytes for state in per_rank) / 2**20,
        rank_step_time_ms_p50=[s.p50_ms for s in stats],
        data_wait_ms_p50=(max(step_stats(state.data_wait_s).p50_ms for state in per_rank)
                          if all(state.data_wait_s for state in per_rank) else None),
    )


def benchmark_metrics(
    repetitions: list[list[RepetitionState]],
    throughput_unit: str,
    peak_flops_per_device: float | None,
) -> dict[str, float]:
    """The run's metrics: headline figures over repetitions plus quality of the last one."""
    summaries = [s for s in (summarise_repetition(r, throughput_unit) for r in repetitions) if s]
    metrics: dict[str, float] = {"repetitions_completed": float(len(summaries))}
    if summaries:
        throughputs = [s.throughput for s in summaries]
        world = len(repetitions[0])
        metrics.update(
            throughput=olympic_mean(throughputs),
            throughput_cv=coefficient_of_variation(throughputs),
            throughput_min=min(throughputs),
            throughput_max=max(throughputs),
            samples_per_s=olympic_mean([s.samples_per_s for s in summaries]),
            step_time_ms_p50=olympic_mean([s.step_time_ms_p50 for s in summaries]),
            step_time_ms_p90=olympic_mean([s.step_time_ms_p90 for s in summaries]),
            step_time_ms_p99=olympic_mean([s.step_time_ms_p99 for s in summaries]),
            step_time_ms_mean=olympic_mean([s.step_time_ms_mean for s in summaries]),
            step_time_cv=olympic_mean([s.step_time_cv for s in summaries]),
            peak_memory_mb=max(s.peak_memory_mb for s in summaries),
        )
        waits = [s.data_wait_ms_p50 for s in summaries]
        if all(w is not None for w in waits):
            metrics["data_wait_ms_p50"] = olympic_mean(waits)  # type: ignore[arg-type]
        flops = [s.achieved_flops for s in summaries]
        if all(f is not None for f in flops):
            achieved = olympic_mean(flops)  # type: ignore[arg-type]
            metrics["achieved_tflops"] = achieved / 1e12
            if peak_flops_per_device:
                metrics["mfu"] = achieved / (peak_flops_per_device * world)
        # per rank, aggregated over repetitions like the job's figures (so one rank's equals the job's)
        per_rank = [olympic_mean(list(p50s)) for p50s in zip(*(s.rank_step_time_ms_p50 for s in summaries),
                                                             strict=True)]
        for rank, p50 in enumerate(per_rank):
            metrics[f"step_time_ms_p50_rank{rank}"] = p50
        if world > 1:
            slowest, fastest = max(per_rank), min(per_rank)
            metrics["rank_imbalance"] = (slowest - fastest) / slowest if slowest > 0 else 0.0
    # Loss, quality and the workload's own figures: repetition 0 (the configured seed), the run whose
    # curves are logged beside them; how many repetitions reached the target says the rest.
    first = repetitions[0][0]
    finite_losses = [x for x in first.losses if math.isfinite(x)]
    if finite_losses:
        metrics["loss"] = finite_losses[-1]
    metrics.update(first.extras)
    metrics.update(first.quality)
    reached = [reps[0].target_reached for reps in repetitions]
    if first.target is not None and all(r is not None for r in reached):
        metrics["quality_target_value"] = first.target.value
        metrics["quality_target_reached"] = float(all(reached))
        metrics["quality_target_reps_reached"] = float(sum(bool(r) for r in reached))
        times = [reps[0].time_to_train_s for reps in repetitions]
        if all(reached) and all(t is not None for t in times):  # MLPerf: time to train exists only at the target
            metrics["time_to_train_s"] = olympic_mean(times)  # type: ignore[arg-type]
    return metrics


def mfu_doubt(metrics: dict[str, float], ceiling: float, peak_doubt: str | None) -> str | None:
    """Why the run's MFU cannot be taken at face value (a sentence), or None: above what the platform
    credibly reaches, or against a measured peak that is itself in doubt."""
    if "mfu" not in metrics:
        return None
    reasons = []
    if metrics["mfu"] > ceiling:
        reasons.append(f"MFU {100 * metrics['mfu']:.0f} % is above the {100 * ceiling:.0f} % this platform credibly "
                       f"reaches, so the peak it is measured against is likely low")
    if peak_doubt:
        reasons.append(f"the measured peak is doubtful ({peak_doubt})")
    if not reasons:
        return None
    return "; ".join(reasons) + ": re-measure the peak on a quiet machine (cobench calibrate --force)"


def noise_verdict(metrics: dict[str, float], step_cv_max: float, rep_cv_max: float) -> str | None:
    """Why a run's figures are too noisy to trust (a sentence), or None."""
    reasons = []
    if metrics.get("step_time_cv", 0.0) > step_cv_max:
        reasons.append(f"step-time cv {100 * metrics['step_time_cv']:.0f} % > {100 * step_cv_max:.0f} %")
    if metrics.get("repetitions_completed", 0) > 1 and metrics.get("throughput_cv", 0.0) > rep_cv_max:
        reasons.append(f"repetition cv {100 * metrics['throughput_cv']:.0f} % > {100 * rep_cv_max:.0f} %")
    if not reasons:
        return None
    return (f"{' and '.join(reasons)}: the machine was busy or the steps differ; rerun on a quiet machine "
            f"(limits: runner.noise_step_cv_max, runner.noise_rep_cv_max)")


# Every metric a suite gates or reports: name → (unit, definition). The documentation's metric table
# (docs/metrics.md) is rendered from this (:func:`metric_table`) when the site is built.
METRIC_DEFINITIONS: dict[str, tuple[str, str]] = {
    "throughput": ("tokens/s or samples/s (tag `throughput_unit`)",
                   "per repetition, every rank's timed work ÷ the slowest rank's timed seconds; the olympic mean "
                   "over repetitions (the mean without the fastest and slowest when there are 3 or more)"),
    "throughput_cv": ("fraction", "standard deviation ÷ mean of the repetitions' throughputs"),
    "throughput_min": ("as throughput", "the slowest repetition's throughput"),
    "throughput_max": ("as throughput", "the fastest repetition's throughput"),
    "samples_per_s": ("samples/s", "as throughput, counting samples (sequences, examples)"),
    "step_time_ms_p50": ("ms", "median of the job's step time (at each step, the slowest rank's), olympic mean over "
                               "repetitions"),
    "step_time_ms_p90": ("ms", "90th percentile of the job's step time, olympic mean over repetitions"),
    "step_time_ms_p99": ("ms", "99th percentile of the job's step time, olympic mean over repetitions"),
    "step_time_ms_mean": ("ms", "mean of the job's step time, olympic mean over repetitions"),
    "step_time_cv": ("fraction", "standard deviation ÷ mean of the job's step times, olympic mean over repetitions"),
    "data_wait_ms_p50": ("ms", "median time a timed step waited for its batch (reading, tokenizing and moving it to "
                               "the device, beyond what the background prefetch had ready), the slowest rank's, "
                               "olympic mean over repetitions; workloads that read data report it (serving: the "
                               "median, over a test's queries, of the time from the engine taking a query up to its "
                               "prompt tokens being on the device)"),
    "mfu_suspect": ("0 or 1", "1 when the MFU is above what the platform credibly reaches (70 % on a CPU, 85 % on "
                              "an accelerator) or its measured peak is in doubt; tags `mfu_suspect`, "
                              "`mfu_suspect_reason`"),
    "step_time_ms_p50_rank<r>": ("ms", "rank r's own median step time, olympic mean over repetitions"),
    "rank_imbalance": ("fraction", "(slowest rank's step_time_ms_p50_rank<r> − fastest's) ÷ slowest's; "
                                   "only with more than one rank"),
    "achieved_tflops": ("TFLOP/s", "model FLOPs per step (torch.utils.flop_counter, all ranks) × timed steps ÷ the "
                                   "slowest rank's timed seconds, olympic mean over repetitions"),
    "mfu": ("fraction", "achieved FLOP/s ÷ (peak FLOP/s per device × world size), the peak for the dtype the matmuls "
                        "run in (tag `peak_flops_source`)"),
    "peak_flops": ("FLOP/s", "the peak per device MFU is taken against (tag `peak_flops_source`: declared, table or "
                             "measured_gemm, the best of square GEMMs on this device, measured once more at the "
                             "run's end where the MFU came out above what the platform credibly reaches)"),
    "peak_memory_mb": ("MiB", "largest over repetitions and ranks: the allocator's peak on accelerators, "
                              "the process RSS peak on CPU"),
    "loss": ("as the workload's loss", "the last finite training loss of repetition 0 (rank 0)"),
    "time_to_train_s": ("s", "from run_start to the end of the repetition's training, olympic mean over "
                             "repetitions; only when every repetition reached the quality target"),
    "quality_target_reached": ("0 or 1", "1 when every repetition reached the workload's quality target"),
    "quality_target_reps_reached": ("count", "repetitions that reached the quality target"),
    "quality_target_value": ("as the target metric", "the workload's quality target (e.g. eval_loss <= value)"),
    "noisy": ("0 or 1", "1 when step_time_cv > runner.noise_step_cv_max or, with repetitions, throughput_cv > "
                        "runner.noise_rep_cv_max: the figures are not to be trusted (tag `noise_reason`)"),
    "repetitions_completed": ("count", "repetitions with at least one timed step"),
    "eval_loss": ("nats per token", "llama: mean cross-entropy on the held-out batches (repetition 0)"),
    "auc": ("0 … 1", "dlrm: ROC AUC of the click predictions on the held-out batches (repetition 0)"),
    "hr_at_10": ("0 … 1", "seqrec: share of held-out next items ranked in the top 10 (repetition 0)"),
    "ndcg_at_10": ("0 … 1", "seqrec: normalised discounted cumulative gain of the next item at 10 (repetition 0)"),
    "time_error_pct": ("%", "abs(replay step ÷ source step − 1) × 100: side by side in one process, the median "
                            "of the rounds' own ratios (`cobench trace fidelity`, suites, qualify), else replay "
                            "p50 vs the capture's plain steps"),
    "time_error_signed_pct": ("%", "(replay step ÷ source step − 1) × 100; positive: the replay is slower"),
    "time_error_ci_low_pct": ("%", "lower end of the 95 % bootstrap interval of time_error_signed_pct "
                                   "(resampling pairs of rounds and the capture's measurements; every other draw "
                                   "moved to the host time the program had while judged)"),
    "time_error_ci_high_pct": ("%", "upper end of that interval"),
    "fidelity_valid": ("0 or 1", "1 when every op of the replay ran and made the shapes the program made, the "
                                 "captured steps are the program's kind, there were ≥ 20 rounds and the "
                                 "interval's half-width is ≤ 2.5 %"),
    "op_coverage_pct": ("%", "ops of the spec that ran ÷ ops of the spec × 100"),
    "ops_divergent": ("ops", "ops of a replay that ran but made other output shapes than the program did (values "
                             "that decide shapes, replayed otherwise): any makes fidelity_valid 0"),
    "category_distance": ("0 … 1", "total variation distance between the source's and the replay's time shares per "
                                   "op category: ½ Σ abs(share_replay − share_source)"),
    "a2a_compression_ratio": ("ratio", "dlrm: float32 bytes this rank's pooled-embedding all-to-alls would send per "
                                       "step ÷ the bytes they sent"),
    "codec_ms_per_step": ("ms", "dlrm: encode + decode time of the all-to-all codecs (forward and backward) per "
                                "training step on this rank, first step excluded; agreed packing's size exchange "
                                "is not in it (codec_exchange_ms_per_step: waiting for the slowest rank)"),
    "codec_break_even_gbps": ("GB/s", "dlrm: bytes the codec saves per step ÷ its time per step: on links slower than "
                                      "this (per rank) compressing wins"),
    "step_projected_ms_<bw>GBps": ("ms", "dlrm: the step with the measured all-to-all wait (and a codec's size "
                                         "exchange) replaced by bytes sent ÷ <bw> GB/s (codec work stays as "
                                         "measured)"),
    "memory_error_pct": ("%", "(replay step peak − source step peak) ÷ (source step peak + what lives across steps) "
                              "× 100, each side's peak from the allocator's accounting"),
    "active_params": ("count", "llama: parameters one token uses: everything but the routed experts, plus k of "
                               "each MoE layer's E experts"),
    "expert_load_max_over_mean": ("ratio", "llama MoE: tokens routed to the busiest expert ÷ the mean per expert, "
                                           "per step, averaged over the timed steps; the worst MoE layer "
                                           "(per layer: expert_load_max_over_mean_layer<i>)"),
    "tokens_dropped": ("count", "llama MoE: routed token slots not computed (dropless routing: 0)"),
    "a2a_share": ("fraction", "llama MoE with expert parallelism: all-to-all time ÷ step time, per step, rank 0"),
    "tp_comm_share": ("fraction", "llama layouts: the tensor-parallel collectives' time ÷ the step's, in the last "
                                  "warm-up step with every collective made blocking (no overlap), rank 0"),
    "dp_comm_share": ("fraction", "llama layouts: the data-parallel (FSDP/HSDP) collectives' time ÷ the step's, "
                                  "measured as tp_comm_share"),
    "pp_bubble_share": ("fraction", "llama layouts: time a stage waits for the pipeline's sends and receives ÷ the "
                                    "step's (the bubble plus the transfers), last warm-up step, rank 0"),
    "tp_comm_mb_per_step": ("MB", "llama layouts: the tensor-parallel collectives' sizes per step (each its whole "
                                  "gathered or reduced tensor), rank 0"),
    "dp_comm_mb_per_step": ("MB", "llama layouts: the data-parallel collectives' sizes per step, rank 0"),
    "pp_comm_mb_per_step": ("MB", "llama layouts: what the pipeline stage sends and receives per step, rank 0"),
    "busbw_gbps": ("GB/s", "collectives: algbw × nccl-tests' bus factor (all_reduce 2(n−1)/n; all_gather, "
                           "reduce_scatter, all_to_all (n−1)/n; broadcast, reduce, send_recv 1) at the sweep's "
                           "largest size, p50 time (each sample the slowest rank's)"),
    "algbw_gbps": ("GB/s", "collectives: message bytes ÷ p50 time at the sweep's largest size"),
    "latency_us_p50": ("µs", "collectives: median time of the sweep's smallest message"),
    "pg_startup_s": ("s", "collectives: creating a fresh process group and its first barrier"),
    "stall_s": ("s", "ft: the survivors' longest step beyond their median step, around the failure"),
    "recovery_s": ("s", "ft: from the kill to the restarted replica group's first committed step"),
    "steps_lost": ("count", "ft: committed steps that had to be trained again after the failure"),
    "effective_training_time_pct": ("%", "ft: time spent in steps that count ÷ wall time × 100"),
    "goodput": ("fraction", "ft: every replica group's time in steps that count ÷ wall time, weighted by the "
                            "samples a group trains a step (a group's absence is lost time)"),
    "weights_identical": ("0 or 1", "ft: 1 when every replica's weights are bit-identical after healing"),
}


def defines(metric: str) -> bool:
    """Whether ``metric`` is one of :data:`METRIC_DEFINITIONS` (``…_rank3`` matches ``…_rank<r>``)."""
    return metric in METRIC_DEFINITIONS or re.sub(r"_rank\d+$", "_rank<r>", metric) in METRIC_DEFINITIONS


def metric_table() -> str:
    """The metric definitions as a Markdown table (docs/metrics.md shows it where its marker is)."""
    lines = ["| metric | unit | definition |", "|---|---|---|"]
    lines += [f"| `{name}` | {unit} | {definition} |" for name, (unit, definition) in METRIC_DEFINITIONS.items()]
    return "\n".join(lines) + "\n"
