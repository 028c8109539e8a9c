"""Data at scale: prepare throughput, the pipeline from token shards against what a `gpu_1b` step
consumes, and peak memory / time to the first step of training from raw files and from shards.

    python -m benchmarks.data_shards [--sizes-mb 6,60,600] [--workers N] [--parts P,...] [--keep]

1. Consumption: `configs/gpu_1b.yaml`'s training FLOPs per token (train/telemetry/mfu.py) and an
   H100 SXM's dense bf16 peak (989 TFLOP/s) at 30% MFU give the tokens/s one GPU eats.
2. Prepare: tokens/s of `python -m train.data.prepare` on the 60 MB jsonl corpus with one worker
   and with every core, and its peak RSS.
3. Pipeline: tokens/s of `make_dataset` reading the largest prepared corpus at gpu_1b's shape
   (8 x 4096), after the row-shuffle window is full; headroom = that / consumption (target >= 10).
4. Start-up: `python -m train` (configs/tiny.yaml, one step, warm compilation cache) on corpora of
   6, 60 and 600 MB, as 1 kB jsonl documents and as one .txt file, raw and prepared: wall time to
   the end of the first step and peak RSS (each run its own process, measured by wait4).

Corpora are built from the running Python's standard-library sources under a temporary directory
and deleted afterwards (unless --keep).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, machine, markdown_table, save

REPO = Path(__file__).resolve().parents[1]
H100_BF16_PEAK = 989e12  # FLOP/s, dense, SXM
MFU = 0.30
RUN = ["--config", str(REPO / "configs" / "tiny.yaml"), "train.steps=1", "train.warmup_steps=1",
       "train.eval_every=0",
       "train.progress=false", "train.peak_flops=1e9", "train.log_every=1"]


def consumption() -> dict:
    from train.config import load_run_config
    from train.telemetry.mfu import train_flops_per_token

    run = load_run_config(REPO / "configs" / "gpu_1b.yaml")
    flops = train_flops_per_token(run.model, run.train.seq_len, run.trained_mtp_heads())
    return {"gpu_1b_train_flops_per_token": flops, "h100_bf16_peak_flops": H100_BF16_PEAK,
            "mfu": MFU, "tokens_per_s": MFU * H100_BF16_PEAK / flops,
            "seq_len": run.train.seq_len, "batch_size": run.train.batch_size}


def write_corpora(root: Path, sizes_mb: list[int]) -> dict[str, Path]:
    """{name: path}: for each size, `web_{mb}mb.jsonl` (~1 kB documents) and `book_{mb}mb.txt`."""
    from train.data.corpus import stdlib_documents

    text = "\n".join(d.text for d in stdlib_documents())
    corpora = {}
    for mb in sizes_mb:
        target = mb * 10**6
        path = root / f"web_{mb}mb" / "web.jsonl"
        path.parent.mkdir()
        with open(path, "w", encoding="utf-8") as f:
            written = 0
            for n in itertools.count():
                start = (n * 997) % (len(text) - 1200)
                line = json.dumps({"text": text[start:start + 800 + n % 400]}) + "\n"
                f.write(line)
                written += len(line)
                if written >= target:
                    break
        corpora[f"web_{mb}mb"] = path
        path = root / f"book_{mb}mb" / "book.txt"
        path.parent.mkdir()
        with open(path, "w", encoding="utf-8") as f:
            for _ in range(target // len(text)):
                f.write(text)
            f.write(text[:target % len(text)])
        corpora[f"book_{mb}mb"] = path
    return corpora


def measured(command: list[str]) -> dict:
    """Runs `command` -> {seconds, peak_rss_mb} (wait4: the peak of the process and of its
    waited-for children), or raises with the end of its output."""
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode:
            log.seek(0)
            raise RuntimeError(f"{' '.join(command)} failed:\n{log.read()[-3000:]}")
    return {"seconds": seconds, "peak_rss_mb": usage.ru_maxrss / 1024}


def prepare(source: Path, out: Path, workers: int) -> dict:
    result = measured([sys.executable, "-m", "train.data.prepare", "--source", str(source),
                       "--out", str(out), "--workers", str(workers), "--no-progress"])
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = sum(s["tokens"] for s in manifest["splits"].values())
    return {"workers": workers, "tokens": tokens, "seconds": result["seconds"],
            "tokens_per_s": tokens / result["seconds"], "peak_rss_mb": result["peak_rss_mb"],
            "input_mb": sum(i.get("bytes", 0) for i in manifest["inputs"]) / 1e6}


def first_step(source: Path, workdir: Path, cache: Path) -> dict:
    """`python -m train` for one step on `source` (raw file or prepared directory)."""
    shutil.rmtree(workdir, ignore_errors=True)
    result = measured([sys.executable, "-m", "train", *RUN, "--workdir", str(workdir),
                       f"train.data.source={source}", f"train.xla_cache_dir={cache}"])
    shutil.rmtree(workdir, ignore_errors=True)
    return {"seconds": result["seconds"], "peak_rss_mb": result["peak_rss_mb"]}


def pipeline_rate(source: Path, seq_len: int, batch_size: int, workers: int = 0,
                  batches: int = 60) -> dict:
    """tokens/s of the train stream of `source` (raw or prepared) once its first batch (and so
    its row-shuffle window) is ready."""
    from model.tokenizers.text import load_tokenizer
    from train.config import DataConfig
    from train.data.pipeline import make_dataset

    data = make_dataset(DataConfig(source=str(source), num_workers=workers),
                        load_tokenizer("default"), seq_len=seq_len, batch_size=batch_size,
                        split="train", seed=0)
    start = time.perf_counter()
    next(data)  # fills the row-shuffle window
    first = time.perf_counter() - start
    start, tokens = time.perf_counter(), 0
    for batch in itertools.islice(data, batches):
        tokens += batch["tokens"].size
    return {"source": source.name, "num_workers": workers, "first_batch_s": first,
            "tokens_per_s": tokens / (time.perf_counter() - start)}


PARTS = ("prepare", "pipeline", "start-up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="6,60,600")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="prepare's worker processes for 'all cores' (default: all)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="which measurements (default: all); the others keep their results")
    parser.add_argument("--keep", action="store_true", help="keep the corpora and shards")
    args = parser.parse_args()
    sizes, parts = [int(s) for s in args.sizes_mb.split(",")], args.parts.split(",")
    path = RESULTS / "data_shards.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    record.update(machine={**machine(), "shared": True}, consumption=consumption())
    root = Path(tempfile.mkdtemp(prefix="stepjax-data-bench-"))
    try:
        corpora = write_corpora(root, sizes)
        middle = f"web_{sizes[len(sizes) // 2]}mb"
        if "prepare" in parts:
            record["prepare"] = [prepare(corpora[middle], root / f"{middle}.prep{w}", w)
                                 for w in sorted({1, args.workers})]
        prepared = {name: root / f"{name}.prepared" for name in corpora}
        needed = corpora if "start-up" in parts else [f"web_{max(sizes)}mb"]
        for name in needed:
            record.setdefault("prepare_all", {})[name] = prepare(corpora[name], prepared[name],
                                                                args.workers)
        if "pipeline" in parts:
            # At gpu_1b's batch shape; side by side: shards in-process and in worker
            # processes, and the same kind of documents read raw (tokenized on the fly).
            largest, consumer = f"web_{max(sizes)}mb", record["consumption"]
            shape = (consumer["seq_len"], consumer["batch_size"])
            record["pipeline"] = [
                {**pipe, "headroom": pipe["tokens_per_s"] / consumer["tokens_per_s"]}
                for pipe in (pipeline_rate(prepared[largest], *shape),
                             pipeline_rate(prepared[largest], *shape, workers=args.workers),
                             pipeline_rate(corpora[middle].parent, *shape))]
        if "start-up" in parts:
            cache = root / "xla-cache"
            first_step(corpora[f"web_{min(sizes)}mb"], root / "warm", cache)  # compiles once
            record["first_step"] = {f"{name} {kind}": first_step(source, root / "run", cache)
                                    for name in corpora
                                    for kind, source in (("raw", corpora[name].parent),
                                                         ("prepared", prepared[name]))}
        for part in parts:
            record.setdefault("measured", {})[part] = time.strftime("%Y-%m-%d %H:%M")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    report(record)
    save("data_shards", record)


def report(record: dict) -> None:
    consumer = record["consumption"]
    peak = consumer["h100_bf16_peak_flops"] / 1e12
    print(f"gpu_1b: {consumer['gpu_1b_train_flops_per_token'] / 1e9:.3f} GFLOP per trained "
          f"token; one H100 at {consumer['mfu']:.0%} of {peak:.0f} TFLOP/s eats "
          f"{consumer['tokens_per_s']:,.0f} tokens/s")
    print(markdown_table(["prepare (jsonl)", "workers", "tokens/s", "per worker", "peak RSS"], [
        [f"{p['input_mb']:.0f} MB", str(p["workers"]), f"{p['tokens_per_s'] / 1e6:.2f}M",
         f"{p['tokens_per_s'] / p['workers'] / 1e6:.2f}M", f"{p['peak_rss_mb']:.0f} MB"]
        for p in record["prepare"]]))
    print(markdown_table(
        [f"pipeline ({consumer['batch_size']} x {consumer['seq_len']})", "worker processes",
         "tokens/s", "x gpu_1b on an H100", "first batch"],
        [[p["source"], str(p["num_workers"]), f"{p['tokens_per_s'] / 1e6:.2f}M",
          f"{p['headroom']:.1f}", f"{p['first_batch_s']:.1f} s"] for p in record["pipeline"]]))
    print(markdown_table(["corpus", "time to first step", "peak RSS"], [
        [name, f"{r['seconds']:.1f} s", f"{r['peak_rss_mb']:.0f} MB"]
        for name, r in record["first_step"].items()]))


if __name__ == "__main__":
    main()
