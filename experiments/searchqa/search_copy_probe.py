"""Whether a SearchQA policy copies what it must copy: names from the question into its
searches, and spans of the retrieved passages into its answers.

    python experiments/searchqa/search_copy_probe.py runs/<run>/eval/baseline runs/<run>/eval/final

Reads saved evaluation records (``records.jsonl`` of a run's ``eval/<phase>`` folder) and
prints, per folder: how many searches were made, the share whose query is a verbatim part of
the question (``<search>`` of a garbled name finds the wrong entity), how many answers were
given, the share that appear verbatim in the passages the policy had seen, and exact match.
The made-up knowledge base is built of rare names the tokenizer splits into many pieces, so
verbatim copying is what the task asks of a policy first.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from agents.record import load_records

TAG = re.compile(r"<(search|answer)>(.*?)(?:</\1>|$)", re.S)
QUESTION = re.compile(r"Question: (.*?)\n")
INFORMATION = re.compile(r"<information>(.*?)</information>", re.S)


def norm(text: str) -> str:
    """Lower case, punctuation as spaces, single spaces: a copy that drops a comma still counts."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def probe(folder: Path) -> dict[str, float]:
    return probe_records(load_records(folder))


def probe_records(records) -> dict[str, float]:
    """The copy shares of SearchQA trajectory records (see the module docstring)."""
    searches = copied = answers = grounded = 0
    for rec in records:
        seen = ""
        for turn in rec.turns:
            question = QUESTION.search(turn.observation)
            seen += " ".join(INFORMATION.findall(turn.observation))
            match = TAG.search(turn.reply)
            if match is None:
                continue
            kind, text = match.group(1), norm(match.group(2))
            if kind == "search":
                searches += 1
                copied += bool(text) and question is not None and text in norm(question.group(1))
            else:
                answers += 1
                grounded += bool(text) and text in norm(seen)
    return {"episodes": len(records), "searches": searches, "query_in_question": copied / max(searches, 1),
            "answers": answers, "answer_in_passages": grounded / max(answers, 1),
            "exact_match": sum(r.success for r in records) / max(len(records), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="eval/<phase> folders of SearchQA runs")
    args = parser.parse_args()
    print(f"{'records':<48} {'episodes':>8} {'searches':>8} {'query in question':>17} {'answers':>7} "
          f"{'answer in passages':>18} {'EM':>6}")
    for folder in args.folders:
        row = probe(folder)
        print(f"{str(folder):<48} {row['episodes']:>8} {row['searches']:>8} {row['query_in_question']:>17.2f} "
              f"{row['answers']:>7} {row['answer_in_passages']:>18.2f} {row['exact_match']:>6.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
