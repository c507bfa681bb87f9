"""The learning task's reward rule as a replay-gate evaluator (`tests.token_rule:score`).

The learning task (tests/e2e/test_learning_e2e.py) rewards the fraction of an answer's tokens that
fall in a set S. The gate sees an answer's text, not its token ids, so the text is encoded again with
the served model's tokenizer; the task rule names both: `{"tokenizer": DIR, "tokens": [ids of S]}`.
"""

from __future__ import annotations

from functools import cache

from proxy.evaluation.cases import Answer, EvalCase


@cache
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def score(case: EvalCase, answer: Answer) -> float:
    expected = case.expected
    if not isinstance(expected, dict) or not isinstance(expected.get("tokenizer"), str):
        raise ValueError(f"case {case.id}: expected must be {{'tokenizer': DIR, 'tokens': [...]}}")
    subset = set(expected.get("tokens") or [])
    ids = _tokenizer(expected["tokenizer"])(answer.text, add_special_tokens=False)["input_ids"]
    return sum(i in subset for i in ids) / len(ids) if ids else 0.0
