"""Queries per second of the search retrieval paths, side by side.

    .venv/bin/python benchmarks/search_bench.py [--passages 100000] [--queries 400] [--batch 64]

For the embedded default corpus and a synthetic corpus of ``--passages`` passages (Zipf-drawn
made-up words, ~40 per passage), measures: the index build (first start, then cached load),
in-process ``BM25Retriever.search`` on the whole query list at once, and the real server
(``python -m envs.search.server`` in a subprocess) through ``HTTPRetriever`` with one query
per request and with ``--batch`` queries per request. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from envs.search import BM25Retriever, HTTPRetriever, kb


def synthetic_corpus(path: Path, n: int, seed: int = 0) -> list[str]:
    """Write ``n`` passages of Zipf-distributed made-up words; return a vocabulary sample for queries."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, size=rng.integers(4, 10))) for _ in range(50_000)]
    with path.open("w") as f:
        for i in range(n):
            words = rng.zipf(1.3, size=40) % len(vocab)
            title = " ".join(vocab[w] for w in words[:2])
            f.write(json.dumps({"id": str(i), "contents": title + "\n" + " ".join(vocab[w] for w in words)}) + "\n")
    return vocab


def start_server(corpus: Path, cache: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, FRESHPER_CACHE=str(cache))
    proc = subprocess.Popen([sys.executable, "-m", "envs.search.server", "--corpus", str(corpus), "--port", "0",
                             "--log-level", "WARNING"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    return proc, line.split(" at ")[1].strip()


def rate(fn, n_queries: int) -> float:
    start = time.perf_counter()
    fn()
    return n_queries / (time.perf_counter() - start)


def bench(name: str, corpus: Path, queries: list[str], batch: int, cache: Path) -> dict[str, str]:
    start = time.perf_counter()
    BM25Retriever(corpus, cache_dir=cache / "search" / "index")
    build = time.perf_counter() - start
    start = time.perf_counter()
    local = BM25Retriever(corpus, cache_dir=cache / "search" / "index")
    load = time.perf_counter() - start
    local.search(queries[:5], 3)  # warm-up
    in_process = rate(lambda: local.search(queries, 3), len(queries))
    proc, url = start_server(corpus, cache)
    try:
        http = HTTPRetriever(url, timeout=60, retries=0)
        http.search(queries[:5], 3)
        single_n = max(len(queries) // 4, 20)
        single = rate(lambda: [http.search([q], 3) for q in queries[:single_n]], single_n)
        batched = rate(lambda: [http.search(queries[i : i + batch], 3) for i in range(0, len(queries), batch)],
                       len(queries))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"corpus": name, "passages": f"{len(local):,}", "build s": f"{build:.1f}", "load s": f"{load:.2f}",
            "in-process q/s": f"{in_process:,.0f}", "HTTP 1/request q/s": f"{single:,.0f}",
            f"HTTP {batch}/request q/s": f"{batched:,.0f}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passages", type=int, default=100_000, help="size of the synthetic corpus")
    parser.add_argument("--queries", type=int, default=400, help="queries per measurement")
    parser.add_argument("--batch", type=int, default=64, help="queries per HTTP request, batched mode")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        os.environ["FRESHPER_CACHE"] = str(cache)
        paths = kb.default_paths()
        questions = [json.loads(line)["question"] for line in paths["test"].open()]
        qs = (questions * (args.queries // len(questions) + 1))[: args.queries]
        rows.append(bench("default (fictional KB)", paths["corpus"], qs, args.batch, cache))
        synthetic = cache / "synthetic.jsonl"
        vocab = synthetic_corpus(synthetic, args.passages)
        rng = np.random.default_rng(1)
        qs = [" ".join(vocab[w] for w in rng.zipf(1.3, size=5) % len(vocab)) for _ in range(args.queries)]
        rows.append(bench(f"synthetic {args.passages:,}", synthetic, qs, args.batch, cache))
    header = list(rows[0])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row[h] for h in header) + " |")


if __name__ == "__main__":
    main()
