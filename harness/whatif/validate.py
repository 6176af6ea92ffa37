"""A what-if prediction's error, measured so that the figure means something (``cobench trace predict-validate``,
``measure-pair`` and ``predict --measure``).

Real step times on a shared machine drift by more than a model's error, and not only between sessions: here
a process's step lands in a fast or a slow state (Llama's tiny step 5.2 or 7.1 ms, runs back to back) that
lasts tens of seconds — the host's other tenants taking the second core's time —, so neither a prediction
nor the trace it comes from is judged against a run made at another moment. Each of R rounds captures
afresh and then, per case, predicts from that capture and measures the unchanged configuration (the base) and
the changed one. A change that keeps one process (layers, batch) is measured **side by side in one process**
(:func:`measure_pair`: both models built, their steps interleaved in rounds of 10, as the fidelity judge
runs a source beside its replay), so that both see the host's same state — runs back to back in their own
processes moved Llama's 2× batch ratio from 1.71 to 2.03 as the state flipped between them. A change of
world size runs as short runs in their own processes, back to back, the changed run (``torchrun``) bracketed
by two base runs whose geometric mean is its base. What is judged is the ratio:

    measured ratio  = changed step / base step of the same round (drift common to both cancels)
    predicted ratio = predicted changed step / predicted unchanged step (the edited graph against the
                      unchanged graph, both from the round's capture)
    error           = predicted ratio / measured ratio − 1, one per round: median, min … max over rounds

Naive linear scaling's ratio (the change's factor: 2× layers → 2, 2× batch → 2, 1 → W ranks → 1/W) is judged
the same way beside it. A round in which a run is noisy (the harness's step-time cv limit) or the base's
step is more than 20 % off the round's captured plain step (the machine has left the state the capture
saw) is measured again, at most twice, then kept as it is; the count is reported. The absolute figures
(the median predicted ms against the median measured ms) are reported too.
Each case's MLflow run carries ``prediction_error_pct`` and ``naive_error_pct`` (the medians) with their
ranges, the ratios and the absolute figures.

The captures, predictions and real runs are cobench's own commands, each in a fresh process: the caller
names the module that is the ``cobench`` command (``cli``, run as ``python -m <cli>``), so this engine never
imports the command line. :func:`measure_prediction` is ``predict --measure``'s: the changed configuration run
for real in this process, the prediction's error logged with it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from harness.config import compose_config, to_run_config
from harness.recording.tracking import Tracker
from harness.running.loop import seed_everything
from harness.running.runner import join_process_group, open_workload, run_benchmark
from harness.traces.side_by_side import interleave
from harness.whatif.changes import WORLD_KEYS
from harness.whatif.graph import Graph, load_graph
from harness.whatif.predict import BATCH_KEY, LAYER_KEYS, Prediction, resolved_workload, workload_value

ROUND_RETRIES = 2  # a disturbed round is measured again at most this often (then kept as it is)
# a base step more than this far (relative) from the round's captured plain step: the machine is not in the state
# the capture saw (here a process's step lands fast or slow, DLRM tiny 2.9 or 4.0 ms, Llama tiny 5.1 or 7.0 ms)
CAPTURED_STATE = 0.2
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node"]
PAIR_STEPS_PER_ROUND = 10  # a side-by-side pair's steps per side per round (rounds = steps // this)


def measure_pair(base: list[str], changed: list[str], work_dir: Path, steps: int, warmup: int) -> dict[str, Any]:
    """The base and changed configurations (Hydra overrides) of one workload in this process, their steps
    interleaved in rounds (:func:`harness.traces.side_by_side.interleave`): step medians, the ratio changed /
    base taken within rounds and its 95 % interval (:func:`harness.traces.side_by_side.paired_ratio`)."""
    cfgs = [to_run_config(compose_config([*side, "tracking=off"])) for side in (base, changed)]
    joined = join_process_group(cfgs[0])
    opened = []
    try:
        for name, cfg in zip(("base", "changed"), cfgs, strict=True):
            seed_everything(cfg.seed, cfg.deterministic)
            side = open_workload(cfg, work_dir / name, joined)
            side.workload.setup()
            opened.append(side)
        rounds = max(2, -(-steps // PAIR_STEPS_PER_ROUND))
        result = interleave(opened[0].workload.step, opened[1].workload.step, joined[0].device, rounds=rounds,
                            steps_per_round=PAIR_STEPS_PER_ROUND, warmup=warmup, batch=1,  # `steps` steps each
                            prepare={"source": opened[0].workload.between_steps,  # untimed, as the loop's
                                     "replay": opened[1].workload.between_steps})
    finally:
        for side in opened:
            side.workload.teardown()
    return {"base_ms": result.source_step_ms, "changed_ms": result.replay_step_ms,
            "ratio": result.ratio,
            "ratio_ci": list(result.ratio_ci),
            "base_round_cv_pct": result.source_round_cv_pct, "changed_round_cv_pct": result.replay_round_cv_pct,
            "rounds": rounds, "steps_per_round": PAIR_STEPS_PER_ROUND, "warmup": warmup,
            "base_round_ms": [statistics.median(r) for r in result.source_ms],
            "changed_round_ms": [statistics.median(r) for r in result.replay_ms]}


@dataclass
class CaseResult:
    """One case judged over interleaved rounds, each with its own capture and prediction."""

    workload: str
    case: str
    changes: list[str]
    predicted_ms: list[float]  # per round, from that round's capture
    predicted_ratios: list[float]  # per round: the edited graph / the unchanged graph
    naive_ratio: float  # the change's factor
    base_ms: list[float]  # per round
    changed_ms: list[float]  # per round
    disturbed: int = 0  # rounds measured again: a run noisy, or the machine busier than at the capture

    @property
    def measured_ratios(self) -> list[float]:
        return [c / b for b, c in zip(self.base_ms, self.changed_ms, strict=True)]

    def errors(self, ratios: list[float]) -> list[float]:
        return [100.0 * (r / m - 1.0) for r, m in zip(ratios, self.measured_ratios, strict=True)]

    def summary(self) -> dict[str, Any]:
        ours = self.errors(self.predicted_ratios)
        naive = self.errors([self.naive_ratio] * len(self.base_ms))
        measured_ms, predicted_ms = statistics.median(self.changed_ms), statistics.median(self.predicted_ms)
        return {**asdict(self), "rounds": len(self.base_ms),
                "predicted_ratio": statistics.median(self.predicted_ratios),
                "predicted_ratio_min": min(self.predicted_ratios), "predicted_ratio_max": max(self.predicted_ratios),
                "measured_ratio": statistics.median(self.measured_ratios),
                "measured_ratio_min": min(self.measured_ratios), "measured_ratio_max": max(self.measured_ratios),
                "predicted_step_ms": predicted_ms, "measured_step_ms": measured_ms,
                "base_step_ms": statistics.median(self.base_ms),
                "prediction_error_pct": statistics.median(ours), "prediction_error_min_pct": min(ours),
                "prediction_error_max_pct": max(ours),
                "naive_error_pct": statistics.median(naive), "naive_error_min_pct": min(naive),
                "naive_error_max_pct": max(naive),
                "absolute_error_pct": 100.0 * (predicted_ms / measured_ms - 1.0)}


CASES = ("layers", "batch", "ranks")


def cases_for(graph: Graph, values: dict[str, Any]) -> dict[str, list[str]]:
    """The three changes validated for the captured workload: 2× its repeated layers, 2× batch, 1 → 2 ranks
    (DDP where the workload has a parallelism choice)."""
    layers = workload_value(values, LAYER_KEYS.get(graph.workload, "")) or graph.assign_layers(None)[1]
    batch = workload_value(values, BATCH_KEY)
    return {"layers": [f"workload.{LAYER_KEYS.get(graph.workload)}={2 * (layers or 0)}"],
            "batch": [f"workload.{BATCH_KEY}={2 * (batch or 0)}"],
            "ranks": ["world_size=2", *(["workload.parallelism=ddp"] if "parallelism" in values else [])]}


def _step_ms(run_root: Path, command: list[str]) -> tuple[float, bool]:
    """Run one short real run (``command``, its results under ``run_root``): its step p50 and whether the
    harness found it noisy (step-time cv over ``runner.noise_step_cv_max``)."""
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    (metrics,) = sorted(run_root.glob("runs/*/metrics.json"))
    record = json.loads(metrics.read_text())
    if record.get("status") != "FINISHED":
        raise RuntimeError(f"the real run {metrics.parent} ended {record.get('status')}: {record.get('error')}")
    return float(record["metrics"]["step_time_ms_p50"]), bool(record["metrics"].get("noisy"))


def _measure(where: Path, world: int, workload: list[str], changes: list[str], run: list[str], steps: int,
             warmup: int, cli: str) -> tuple[list[float], bool]:
    """One round's [base, changed] step times and whether a run was noisy: side by side in one process
    (``trace measure-pair``, its record ``<where>-pair.json``: the base's median step, and the changed one
    as that × the ratio measured within rounds, the pair's own figure) when the change keeps one process; else a base
    run, the changed one under torchrun and the base again (``<where>-base``, ``<where>-changed``,
    ``<where>-base-after``), the base's step the two runs' geometric mean. ``cli``: the cobench command's module."""
    here = [sys.executable, "-m", cli]
    if world == 1:
        record = where.with_name(f"{where.name}-pair.json")
        subprocess.run([*here, "trace", "measure-pair", "--out", str(record), "--steps", str(steps), "--warmup",
                        str(warmup), *workload, "--changed", *changes], check=True, stdout=subprocess.DEVNULL)
        measured = json.loads(record.read_text())
        return [measured["base_ms"], measured["base_ms"] * measured["ratio"]], False
    steps_ms, noisy = [], False
    for side, launch, extra in (("base", here, []), ("changed", [*TORCHRUN, str(world), "-m", cli], changes),
                                ("base-after", here, [])):
        root = where.with_name(f"{where.name}-{side}")
        ms, flagged = _step_ms(root, [*launch, "run", *workload, *extra, *run, f"results_dir={root}"])
        steps_ms.append(ms)
        noisy |= flagged
    # the changed run bracketed by two base runs: its ratio is to their geometric mean, so that the host's drift
    # over the three runs moves both sides alike
    return [math.sqrt(steps_ms[0] * steps_ms[2]), steps_ms[1]], noisy


def _capture(bundle: Path, workload: list[str], steps: int, out: Path, cli: str) -> Graph:
    """The graph of a capture into ``bundle`` (taken now unless it is there: a rerun keeps its rounds' captures)."""
    if not (bundle / "meta.json").exists():
        subprocess.run([sys.executable, "-m", cli, "trace", "capture", "--out", str(bundle), "--baseline-steps",
                        str(steps), *workload, "tracking=off", f"results_dir={out / 'capture'}"], check=True,
                       stdout=subprocess.DEVNULL)
    return load_graph(bundle)


def validate(out: Path, overrides: list[str], case_names: list[str], rounds: int, steps: int, warmup: int,
             collectives: Path | None, cli: str) -> list[CaseResult]:
    """R rounds of: a capture into ``out/bundle-<r>``, then per case its prediction from that capture and the
    base and changed runs back to back, each a cobench command (``python -m <cli>``) of its own."""
    unknown = [n for n in case_names if n not in CASES]
    if unknown:  # before the first capture
        raise ValueError(f"unknown case {unknown[0]!r}: choose from {', '.join(CASES)}")
    workload = [o for o in overrides if not o.startswith(("tracking", "results_dir"))]
    graph = _capture(out / "bundle-0", workload, steps, out, cli)
    cases = cases_for(graph, resolved_workload(graph))
    run = ["runner.repetitions=1", f"runner.steps={steps}", f"runner.warmup_steps={warmup}",
           "runner.progress=false", "tracking=off"]
    results = {name: CaseResult(graph.workload, name, cases[name], [], [], 0.0, [], []) for name in case_names}
    for r in range(rounds):
        bundle = out / f"bundle-{r}"
        graph = _capture(bundle, workload, steps, out, cli) if r else graph
        for name, result in results.items():
            changes = cases[name]
            table = ["--collectives", str(collectives)] if name == "ranks" and collectives else []
            predicted = out / f"{name}-{r}.json"
            subprocess.run([sys.executable, "-m", cli, "trace", "predict", str(bundle), *changes, *table, "--json",
                            str(predicted)], check=True, stdout=subprocess.DEVNULL)
            record = json.loads(predicted.read_text())
            # the prediction is the edited graph × measured / unchanged: over the measured step, the graphs' ratio
            result.predicted_ms.append(record["predicted_step_ms"])
            result.predicted_ratios.append(record["predicted_step_ms"] / record["measured_step_ms"])
            result.naive_ratio = record["naive_step_ms"] / record["measured_step_ms"]
            world = next((int(c.partition("=")[2]) for c in changes if c.startswith("world_size=")), 1)
            real = [c for c in changes if not c.startswith("world_size=")]
            for attempt in range(1 + ROUND_RETRIES):
                pair, noisy = _measure(out / "rounds" / f"{name}-{r}-{attempt}", world, workload, real, run, steps,
                                       warmup, cli)
                # a round is judged only on the machine that was captured: neither run noisy, the base within
                # CAPTURED_STATE of the capture's own plain step (else the machine moved to another state)
                if not noisy and abs(pair[0] / graph.measured_step_ms - 1.0) <= CAPTURED_STATE:
                    break
                result.disturbed += 1
                then = "measured again" if attempt < ROUND_RETRIES else "kept"
                print(f"  {graph.workload} {name} round {r + 1}: disturbed (base {pair[0]:.2f} ms against "
                      f"{graph.measured_step_ms:.2f} captured, changed {pair[1]:.2f} ms{', noisy' if noisy else ''}), "
                      f"{then}", flush=True)
            result.base_ms.append(pair[0])
            result.changed_ms.append(pair[1])
            print(f"  {graph.workload} {name} round {r + 1}/{rounds}: captured {graph.measured_step_ms:.2f} ms, "
                  f"predicted ratio {result.predicted_ratios[-1]:.3f}; base {pair[0]:.2f} ms, changed "
                  f"{pair[1]:.2f} ms (ratio {pair[1] / pair[0]:.3f})", flush=True)
    return list(results.values())


def log_cases(results: list[CaseResult], overrides: list[str]) -> dict[str, str]:
    """One MLflow run per case (``whatif-validate-<workload>-<case>``) in the store ``overrides`` name;
    nothing with tracking off. Returns case → run id."""
    store = [o for o in overrides if o.startswith(("tracking", "results_dir", "workload="))]
    cfg = to_run_config(compose_config(store))
    if not cfg.tracking.enabled:
        return {}
    tracker = Tracker.connect(cfg.tracking, Path(cfg.results_dir).resolve())
    ids = {}
    for result in results:
        figures = result.summary()
        run_id = tracker.start_run(f"whatif-validate-{result.workload}-{result.case}",
                                   {"workload": result.workload, "whatif_case": result.case})
        tracker.log_params(run_id, {"changes": " ".join(result.changes), "rounds": figures["rounds"]})
        tracker.log_metrics(run_id, {k: float(v) for k, v in figures.items() if isinstance(v, (int, float))})
        tracker.log_series(run_id, "round_prediction_error_pct", result.errors(result.predicted_ratios))
        tracker.end_run(run_id, "FINISHED")
        ids[result.case] = run_id
    return ids



def run_validation(out: Path, overrides: list[str], case_names: list[str], rounds: int, steps: int, warmup: int,
                   collectives: Path | None, cli: str) -> dict[str, Any]:
    """:func:`validate`, then its table: every case's figures (``rows``, each with its MLflow run's id) and the
    mean absolute errors, ours and naive scaling's, written to ``out/validation.json`` (before MLflow is reached,
    and again with the run ids)."""
    if rounds < 1 or steps < 1:
        raise ValueError("--rounds and --steps must be at least 1")
    results = validate(out, overrides, case_names, rounds, steps, warmup, collectives, cli)
    rows = [r.summary() for r in results]
    summary = {"rows": rows, "rounds": rounds, "steps": steps, "warmup": warmup,
               "mae_pct": statistics.fmean(abs(r["prediction_error_pct"]) for r in rows),
               "naive_mae_pct": statistics.fmean(abs(r["naive_error_pct"]) for r in rows)}
    (out / "validation.json").write_text(json.dumps(summary, indent=2))  # kept should logging fail
    run_ids = log_cases(results, overrides)
    for row in rows:
        row["run_id"] = run_ids.get(row["case"])
    (out / "validation.json").write_text(json.dumps(summary, indent=2))
    return summary


def measure_change(out: Path, overrides: list[str], changed: list[str], steps: int, warmup: int) -> dict[str, Any]:
    """:func:`measure_pair` of the configuration ``overrides`` and it with ``changed`` on top, its record (with
    ``changed``) written to ``out``; its workloads' files go to ``<out>-work``."""
    if steps < 1 or warmup < 0:
        raise ValueError("--steps must be at least 1 and --warmup at least 0")
    if any(c.partition("=")[0] in WORLD_KEYS for c in changed):
        raise ValueError("measure-pair runs both sides in one process: a world-size change needs its own launch")
    record = measure_pair(overrides, [*overrides, *changed], out.parent / f"{out.stem}-work", steps, warmup)
    record["changed"] = changed
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    return record


def measure_prediction(graph: Graph, changes: list[str], overrides: list[str], prediction: Prediction) -> dict:
    """Run the changed configuration for real (the captured workload config, the changes, ``overrides``)
    and log the prediction's error with it: ``prediction_error_pct`` and naive scaling's beside it."""
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
