"""How fast Llama's real-text sources make batches, against how fast tiny Llama trains (reported, never asserted).

    .nox/cobench/bin/python benchmarks/bench_llama_data.py [--work DIR] [--mb 48] [--repeats 3]

Writes C4-shaped shards of generated text (documents of ~400 words, as C4's average) in the en layout,
prepares them into a Megatron indexed dataset, then measures, each ``--repeats`` times with the machine's
load beside it:

- ``c4 read``: documents' text out of the .json.gz files, the two readers (``json``: gzip + json; Hugging Face
  ``datasets``) interleaved, per wall-second and per CPU-second of the process (all its threads);
- ``c4 -> batches``: read, tokenized, packed and batched as a training run does (``C4Stream`` + ``batches``);
- ``megatron -> batches``: windows of the indexed dataset batched (EOS already in the file, and inserted);
- ``prepare``: ``cobench data prepare c4`` (tokens/s written);
- tiny Llama's training throughput (``cobench run workload=llama``, defaults), and runs on the prepared
  data (c4 and megatron) for ``data_wait_ms_p50`` against ``step_time_ms_p50``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from data_files import make_bpe_tokenizer, write_c4  # noqa: E402

from workloads.llama import c4  # noqa: E402
from workloads.llama.text_data import C4Stream, IndexedStream, IndexedTokens, batches  # noqa: E402
from workloads.llama.tokenizer import load_tokenizer  # noqa: E402

SEQ_LEN, BATCH = 64, 8  # tiny Llama's defaults


def load() -> str:
    return os.getloadavg().__repr__()


def make_data(work: Path, megabytes: int) -> tuple[Path, Path]:
    """~``megabytes`` of C4 JSON (uncompressed) in 8 training shards + 1 validation shard, and a tokenizer whose
    vocabulary fits tiny Llama's 512 ids (about one token per word, as a real BPE gives ~1.3)."""
    folder, tokenizer = work / "c4", work / "tokenizer"
    if not (folder / c4.shard_name("validation", 0)).exists():
        per_shard = megabytes * 2**20 // 9 // 2_700  # a ~400-word document is ~2.7 kB of JSON
        write_c4(folder, train_shards=range(768, 776), validation_shards=range(0, 1), documents_per_shard=per_shard,
                 words=400)
    if not (tokenizer / "tokenizer.json").exists():
        make_bpe_tokenizer(tokenizer, vocab_size=500)
    return folder, tokenizer


def timed(label: str, tokens_of, repeats: int, rows: list[dict]) -> None:
    for run in range(repeats):
        before = load()
        start = time.perf_counter()
        amount, unit = tokens_of()
        seconds = time.perf_counter() - start
        rows.append({"stage": label, "run": run, unit: amount, "seconds": round(seconds, 2),
                     f"{unit}_per_s": round(amount / seconds), "load_before": before, "load_after": load()})
        print(json.dumps(rows[-1]), flush=True)


def cobench_run(work: Path, *overrides: str) -> dict:
    results = Path(tempfile.mkdtemp(dir=work, prefix="run-"))
    proc = subprocess.run([sys.executable, "-m", "suite.cli", "run", "workload=llama", f"results_dir={results}",
                           "runner.progress=false", "tracking=off",
                           f"platform.calibration_cache={work / 'calibration.json'}", *overrides],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    (run_dir,) = (results / "runs").iterdir()
    return json.loads((run_dir / "metrics.json").read_text())["metrics"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "cobench-bench-llama-data")
    parser.add_argument("--mb", type=int, default=48, help="uncompressed C4 JSON to generate")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="timed steps of each tiny Llama run")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    folder, tokenizer_path = make_data(args.work, args.mb)
    tokenizer = load_tokenizer(tokenizer_path, 512)
    files = c4.find_shards(folder, "train", None)
    print(json.dumps({"cpu_count": os.cpu_count(), "files": len(files), "compressed_mb": round(
        sum(f.stat().st_size for f in files) / 2**20, 1), "uncompressed_mb": args.mb}), flush=True)
    rows: list[dict] = []

    epoch_windows = _epoch_windows(files, tokenizer)  # one pass over the files, counted untimed
    list(c4.read_texts(files[0], "datasets"))  # import datasets before timing it
    for run in range(args.repeats + 2):  # the two readers interleaved: both see the same load
        for reader in ("json", "datasets"):
            before, start, cpu = load(), time.perf_counter(), time.process_time()
            chars = sum(len(t) for f in files for t in c4.read_texts(f, reader))
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            rows.append({"stage": f"c4 read ({reader})", "run": run, "chars": chars, "seconds": round(wall, 2),
                         "chars_per_s": round(chars / wall), "chars_per_cpu_s": round(chars / cpu),
                         "load_before": before, "load_after": load()})
            print(json.dumps(rows[-1]), flush=True)
    for reader in ("json", "datasets"):
        def c4_batches(r: str = reader) -> tuple[int, str]:
            stream = C4Stream(files, tokenizer, SEQ_LEN, 0, 1, seed=0, shuffle_sequences=1024, reader=r)
            count = 0  # the stream is endless: one epoch's batches
            for _ in itertools.islice(batches(stream.windows(), BATCH), epoch_windows // BATCH):
                count += BATCH * SEQ_LEN
            return count, "tokens"
        timed(f"c4 -> batches ({reader})", c4_batches, args.repeats, rows)

    prefix = args.work / "prepared" / "c4-train"
    def prepare() -> tuple[int, str]:
        from suite.cli import main as cobench

        assert cobench(["data", "prepare", "c4", "--input", str(folder), "--tokenizer", str(tokenizer_path),
                        "--out", str(prefix)]) == 0
        return IndexedTokens(prefix, tokenizer.eos_id, 512).total_tokens, "tokens"
    timed("prepare (json reader)", prepare, args.repeats, rows)

    bare = _without_eos(prefix, tokenizer.eos_id)
    for label, path in (("EOS in the file", prefix), ("EOS inserted", bare)):
        tokens = IndexedTokens(path, tokenizer.eos_id, 512)
        def indexed_batches(t: IndexedTokens = tokens) -> tuple[int, str]:
            stream = IndexedStream(t, SEQ_LEN, t.window_count(SEQ_LEN), 0, 1, seed=0, block=256)
            count = 0
            for _ in batches(itertools.islice(stream.windows(), -(-stream.count // 256)), BATCH):
                count += BATCH * SEQ_LEN
            return count, "tokens"
        timed(f"megatron -> batches ({label})", indexed_batches, args.repeats, rows)

    steps = [f"runner.steps={args.steps}", "runner.warmup_steps=5"]
    for run in range(args.repeats):
        for label, extra in (("synthetic", []),
                             ("c4", ["workload.data=c4", f"workload.data_path={folder}",
                                     f"workload.tokenizer={tokenizer_path}", "workload.eval_sequences=64"]),
                             ("megatron", ["workload.data=megatron", f"workload.data_path={prefix}",
                                           f"workload.tokenizer={tokenizer_path}", "workload.eval_sequences=64"])):
            before = load()
            metrics = cobench_run(args.work, *steps, *extra)
            rows.append({"stage": f"tiny llama train ({label})", "run": run,
                         "tokens_per_s": round(metrics["throughput"]),
                         "step_time_ms_p50": round(metrics["step_time_ms_p50"], 2),
                         "data_wait_ms_p50": round(metrics["data_wait_ms_p50"], 4),
                         "wait_share_pct": round(100 * metrics["data_wait_ms_p50"] / metrics["step_time_ms_p50"], 3),
                         "load_before": before, "load_after": load()})
            print(json.dumps(rows[-1]), flush=True)
    (args.work / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"all rows: {args.work / 'results.json'}")


def _epoch_windows(files: list[Path], tokenizer) -> int:
    """Windows of ``SEQ_LEN + 1`` in one pass over ``files``."""
    tokens = sum(len(ids) + 1 for f in files for chunk in _chunks(c4.read_texts(f, "json"), 1024)
                 for ids in tokenizer.encode_batch(chunk))
    return (tokens - 1) // SEQ_LEN


def _chunks(items, size):
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def _without_eos(prefix: Path, eos_id: int) -> Path:
    """The prepared set rewritten without its EOS tokens (as NeMo's preprocessing writes C4 without --append-eod)."""
    import numpy as np
    from data_files import write_indexed

    bare = prefix.with_name(prefix.name + "-no-eos")
    if not Path(f"{bare}.idx").exists():
        tokens = IndexedTokens(prefix, eos_id, 512)
        write_indexed(bare, [np.asarray(tokens.dataset.get(i)[:-1]) for i in range(len(tokens.lengths))],
                      dtype=str(np.dtype(tokens.dataset.index.dtype)))
    return bare


if __name__ == "__main__":
    main()
