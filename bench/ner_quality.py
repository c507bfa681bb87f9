"""Names and places: precision and recall of PERSON and LOCATION on agent-shaped text, and what NER costs.

The labelled set is `tests/ner_corpus.py`: capitalised-identifier-heavy agent traffic (code, stack
traces, logs, git logs, JSON tool schemas, Markdown, paths, tool output) with names and places
inserted where agents meet them. Every PERSON / LOCATION detection is checked against the labels:
a detection that overlaps no labelled value is a false positive (on agent traffic it costs a step its
token ids when the tokenizer is not known). A labelled value counts as found when no part of it
survives redaction. Also scanned: the real system prompts of Claude Code, Codex CLI and Hermes Agent
(bench/corpus/clients/), where every detection is wrong. Intervals: Wilson, 95%.

Rules were set on the dev split; the held-out split (other seed, disjoint names and places) is the
one to report:

    python bench/ner_quality.py                  # held-out (the reported numbers)
    python bench/ner_quality.py --split dev      # the split to tune on
    python bench/ner_quality.py --out /tmp/ner.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.governance.redaction import RedactionConfig, Redactor  # noqa: E402
from tests.ner_corpus import SPLITS, negatives, positives  # noqa: E402
from tests.redaction_corpus import client_operator_content  # noqa: E402

ENTITIES = ("PERSON", "LOCATION")
_PLACEHOLDER = re.compile(r"<([A-Z_]+)(?::[0-9a-f]{8})?>")


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """The Wilson score interval of a proportion k/n."""
    if n == 0:
        return None
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)


def _entity(replacement: str) -> str:
    m = _PLACEHOLDER.fullmatch(replacement)
    return m.group(1) if m else "?"


def _survives(value: str, redacted: str) -> bool:
    return value in redacted or json.dumps(value)[1:-1] in redacted


def _rate(k: int, n: int) -> dict:
    return {"k": k, "n": n, "value": round(k / n, 4) if n else None, "wilson95": wilson(k, n)}


def measure(split: str, *, n_positive: int, negative_kb: int) -> dict:
    ner = Redactor(RedactionConfig(salt=b"bench"))
    if not ner.ner_status.available:
        raise SystemExit(f"NER model not available: {ner.ner_status.reason}")
    plain = Redactor(RedactionConfig(salt=b"bench", ner_model=None))
    neg = negatives(split, kb=negative_kb)
    pos = positives(split, n=n_positive)

    tp: Counter[str] = Counter()
    fp: Counter[str] = Counter()
    found_k: Counter[str] = Counter()
    total: Counter[str] = Counter()
    fp_examples: list[tuple[str, str, str]] = []
    missed: list[tuple[str, str]] = []
    neg_fp = 0
    for kind, text in neg:
        found: list[tuple[str, str]] = []
        ner.redact_value(text, "bench", found=found)
        for raw, rep in found:
            if _entity(rep) in ENTITIES:
                fp[_entity(rep)] += 1
                neg_fp += 1
                fp_examples.append((kind, _entity(rep), raw[:60]))
    for sample in pos:
        found = []
        out, _ = ner.redact_value(sample.text, "bench", found=found)
        for entity, value in sample.labels:
            total[entity] += 1
            if _survives(value, out):
                missed.append((entity, value))
            else:
                found_k[entity] += 1
        for raw, rep in found:
            entity = _entity(rep)
            if entity not in ENTITIES:
                continue
            if any(raw in v or v in raw for _, v in sample.labels):
                tp[entity] += 1
            else:
                fp[entity] += 1
                fp_examples.append((sample.kind, entity, raw[:60]))

    clients: dict[str, list[str]] = {}
    for client, content in client_operator_content().items():
        found = []
        for part in (content["system"], content["tools"]):  # the full scan (worst case)
            ner.redact_value(part, "bench", found=found)
        clients[client] = [f"{_entity(rep)}: {raw[:40]}" for raw, rep in found if _entity(rep) in ENTITIES]

    texts = [t for _, t in neg] + [s.text for s in pos]
    kb = sum(len(t.encode()) for t in texts) / 1000
    cost = {}
    for name, r in (("without_ner", plain), ("with_ner", ner)):
        t0 = time.perf_counter()
        for t in texts:
            r.redact_value(t, "bench-cost")  # another tenant: no clean-leaf shortcut from the pass above
        cost[name] = round((time.perf_counter() - t0) * 1000 / kb, 3)
    cost["ratio"] = round(cost["with_ner"] / cost["without_ner"], 2)

    per_entity = {
        e: {"precision": _rate(tp[e], tp[e] + fp[e]), "recall": _rate(found_k[e], total[e])} for e in ENTITIES
    }
    all_tp, all_fp = sum(tp.values()), sum(fp.values())
    return {
        "split": split,
        "seed": SPLITS[split],
        "note": "held-out: reported; rules were set on the dev split only" if split == "held-out"
        else "dev: the split to tune on, not to report",
        "model": ner.ner_status.model,
        "negative_kb": round(sum(len(t.encode()) for _, t in neg) / 1000, 1),
        "positive_texts": len(pos),
        "per_entity": per_entity,
        "overall": {"precision": _rate(all_tp, all_tp + all_fp),
                    "recall": _rate(sum(found_k.values()), sum(total.values()))},
        "false_positives_in_negatives_per_100kb": round(
            neg_fp / max(1e-9, sum(len(t.encode()) for _, t in neg) / 1e5), 2),
        "client_system_prompts_full_scan": {c: len(v) for c, v in clients.items()},
        "client_examples": {c: v[:8] for c, v in clients.items() if v},
        "fp_examples": fp_examples[:25],
        "missed": missed[:25],
        "ms_per_kb_one_core": cost,
        "scanned_kb": round(kb, 1),
    }


def _fmt(rate: dict) -> str:
    if rate["value"] is None:
        return "-"
    lo, hi = rate["wilson95"]
    return f"{rate['value']:.3f} [{lo:.3f}, {hi:.3f}] ({rate['k']}/{rate['n']})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", choices=sorted(SPLITS), default="held-out")
    ap.add_argument("--positives", type=int, default=300, help="texts with inserted names and places")
    ap.add_argument("--negative-kb", type=int, default=150, help="KB of agent text without any")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    r = measure(args.split, n_positive=args.positives, negative_kb=args.negative_kb)
    print(f"split: {r['split']} (seed {r['seed']}) - {r['note']}; model {r['model']}")
    for e, row in r["per_entity"].items():
        print(f"{e:9} precision {_fmt(row['precision'])}  recall {_fmt(row['recall'])}")
    print(f"{'all':9} precision {_fmt(r['overall']['precision'])}  recall {_fmt(r['overall']['recall'])}")
    print(f"negatives: {r['negative_kb']} KB of agent text, {r['false_positives_in_negatives_per_100kb']} "
          "false PERSON/LOCATION per 100 KB")
    print(f"client system prompts + tool schemas, full scan: {r['client_system_prompts_full_scan']}")
    c = r["ms_per_kb_one_core"]
    print(f"cost (one core, {r['scanned_kb']} KB): {c['without_ner']} ms/KB without NER, "
          f"{c['with_ner']} ms/KB with it ({c['ratio']}x)")
    for key in ("fp_examples", "missed", "client_examples"):
        if r[key]:
            print(f"{key}: {json.dumps(r[key], ensure_ascii=False)[:1500]}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(r, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
