"""Redaction quality: precision and recall per entity type on a labelled corpus (tests/redaction_corpus.py).

Three measurements, each against a goal of issue #13:
- the real system prompts and tool schemas of Claude Code, Codex CLI and Hermes Agent
  (bench/corpus/clients/): goal 0 detections. Scanned twice: secrets only (the operator scope the
  writer applies to tool schemas) and with the full scan (what the writer applies to system prompts,
  and to any copy of the same text inside a user message or tool result);
- code-like tool output (git log, pip freeze, stack traces, ls -l, JSON API answers, docker ps, logs,
  `cat -n` listings): goal <= 1 false positive per 100 KB;
- seeded PII and secrets of every default entity type inserted into that output: goal recall >= 99%
  (a value counts as found when no part of it survives redaction).

Tune on the dev split, report the held-out split (a different seed: different lookalikes and values):

    python bench/redaction_quality.py                 # held-out split (the reported numbers)
    python bench/redaction_quality.py --split dev     # the split to tune on
    python bench/redaction_quality.py --out /tmp/quality.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.governance.redaction import RedactionConfig, Redactor  # noqa: E402
from tests.redaction_corpus import (  # noqa: E402
    DEV_SEED,
    HELD_OUT_SEED,
    client_operator_content,
    lookalikes,
    seeded,
)

GOAL_RECALL = 0.99
GOAL_FP_PER_100KB = 1.0
_PLACEHOLDER = re.compile(r"<([A-Z_]+)(?::[0-9a-f]{8})?>")


@dataclass
class Quality:
    split: str
    seed: int
    client_detections: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # scope -> client -> found
    lookalike_kb: float = 0.0
    lookalike_fp: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, entity, value)
    seeded_total: Counter[str] = field(default_factory=Counter)
    seeded_found: Counter[str] = field(default_factory=Counter)
    missed: list[tuple[str, str]] = field(default_factory=list)
    detected_tp: Counter[str] = field(default_factory=Counter)
    detected_fp: Counter[str] = field(default_factory=Counter)
    seeded_fp_values: list[tuple[str, str]] = field(default_factory=list)
    kb_per_s: float = 0.0


def _entity(replacement: str) -> str:
    m = _PLACEHOLDER.fullmatch(replacement)
    return m.group(1) if m else "?"


def _overlaps(raw: str, labels: list[tuple[str, str]]) -> bool:
    return any(raw in v or v in raw for _, v in labels)


def _survives(value: str, redacted: str) -> bool:
    """Does any line of the value (a PEM block has several) survive redaction?"""
    parts = [p for p in value.split("\n") if len(p) >= 4] or [value]
    return any(p in redacted or json.dumps(p)[1:-1] in redacted for p in parts)


def measure(split: str, *, per_entity: int = 30, lookalike_kb: int = 300) -> Quality:
    seed = HELD_OUT_SEED if split == "held-out" else DEV_SEED
    q = Quality(split=split, seed=seed)
    r = Redactor(RedactionConfig(salt=b"bench"))

    for scope, operator in (("operator", True), ("full", False)):
        per_client: dict[str, list[str]] = {}
        for client, content in client_operator_content().items():
            found: list[tuple[str, str]] = []
            for part in (content["system"], content["tools"]):
                r.redact_value(part, "bench", found=found, operator=operator)
            per_client[client] = [f"{_entity(rep)}: {raw[:60]}" for raw, rep in found]
        q.client_detections[scope] = per_client

    scanned = 0
    t0 = time.perf_counter()
    for kind, text in lookalikes(seed, kb=lookalike_kb):
        found = []
        r.redact_value(text, "bench", found=found)
        scanned += len(text.encode())
        q.lookalike_fp += [(kind, _entity(rep), raw[:60]) for raw, rep in found]
    q.lookalike_kb = scanned / 1000

    for sample in seeded(seed, per_entity):
        found = []
        out, _ = r.redact_value(sample.text, "bench", found=found)
        scanned += len(sample.text.encode())
        for entity, value in sample.labels:
            q.seeded_total[entity] += 1
            if _survives(value, out):
                q.missed.append((entity, value[:60]))
            else:
                q.seeded_found[entity] += 1
        for raw, rep in found:
            if _overlaps(raw, sample.labels):
                q.detected_tp[_entity(rep)] += 1
            else:
                q.detected_fp[_entity(rep)] += 1
                q.seeded_fp_values.append((_entity(rep), raw[:60]))
    q.kb_per_s = scanned / 1000 / (time.perf_counter() - t0)
    return q


def report(q: Quality) -> dict:
    fp_counts = Counter(e for _, e, _ in q.lookalike_fp) + q.detected_fp
    entities = sorted(set(q.seeded_total) | set(fp_counts) | set(q.detected_tp))
    per_entity = {}
    for e in entities:
        tp, fp = q.detected_tp[e], fp_counts[e]
        total = q.seeded_total[e]
        per_entity[e] = {
            "seeded": total,
            "recall": round(q.seeded_found[e] / total, 4) if total else None,
            "detections": tp + fp,
            "precision": round(tp / (tp + fp), 4) if tp + fp else None,
        }
    recall = sum(q.seeded_found.values()) / max(1, sum(q.seeded_total.values()))
    fp_per_100kb = len(q.lookalike_fp) / q.lookalike_kb * 100
    client = {scope: {c: len(v) for c, v in per.items()} for scope, per in q.client_detections.items()}
    return {
        "split": q.split,
        "seed": q.seed,
        "note": "reported on the held-out split; rules were tuned on the dev split only"
        if q.split == "held-out" else "dev split: the one to tune on, not to report",
        "per_entity": per_entity,
        "seeded_recall": round(recall, 4),
        "goal_recall": GOAL_RECALL,
        "missed": q.missed,
        "lookalike_kb": round(q.lookalike_kb, 1),
        "lookalike_false_positives": len(q.lookalike_fp),
        "fp_per_100kb": round(fp_per_100kb, 3),
        "goal_fp_per_100kb": GOAL_FP_PER_100KB,
        "lookalike_fp_examples": q.lookalike_fp[:20],
        "seeded_text_false_positives": q.seeded_fp_values[:20],
        "client_detections": client,
        "client_detection_examples": {s: {c: v[:10] for c, v in per.items() if v} for s, per in q.client_detections.items()},
        "throughput_kb_per_s_one_core": round(q.kb_per_s, 1),
        "goals_met": {
            "recall": recall >= GOAL_RECALL,
            "clients_operator_scope_zero": all(n == 0 for n in client["operator"].values()),
            "clients_full_scan_zero": all(n == 0 for n in client["full"].values()),
            "fp_per_100kb": fp_per_100kb <= GOAL_FP_PER_100KB,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", choices=("held-out", "dev"), default="held-out")
    ap.add_argument("--per-entity", type=int, default=30, help="seeded values per entity type")
    ap.add_argument("--lookalike-kb", type=int, default=300)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = report(measure(args.split, per_entity=args.per_entity, lookalike_kb=args.lookalike_kb))
    print(f"split: {result['split']} (seed {result['seed']}) - {result['note']}")
    print(f"{'entity':22} {'seeded':>6} {'recall':>7} {'detect':>6} {'precision':>9}")
    for e, row in result["per_entity"].items():
        rec = "-" if row["recall"] is None else f"{row['recall']:.3f}"
        prec = "-" if row["precision"] is None else f"{row['precision']:.3f}"
        print(f"{e:22} {row['seeded']:>6} {rec:>7} {row['detections']:>6} {prec:>9}")
    print(f"seeded recall {result['seeded_recall']:.4f} (goal >= {GOAL_RECALL})")
    print(f"code-like tool output: {result['lookalike_false_positives']} false positives in "
          f"{result['lookalike_kb']} KB = {result['fp_per_100kb']} per 100 KB (goal <= {GOAL_FP_PER_100KB})")
    for scope, per in result["client_detections"].items():
        print(f"client system prompts + tool schemas, {scope} scan: {per} (goal 0)")
    print(f"throughput (one core, all texts): {result['throughput_kb_per_s_one_core']} KB/s")
    print("goals met:", json.dumps(result["goals_met"]))
    for key in ("missed", "lookalike_fp_examples", "seeded_text_false_positives", "client_detection_examples"):
        if result[key]:
            print(f"{key}: {json.dumps(result[key], ensure_ascii=False)[:1500]}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
