"""Memory, the pure parts: what a call asks about, and the facts put into its context.

Retrieval is PostgreSQL full-text search (proxy.store.layers): the facts' `to_tsvector('english', text)`
is stored and GIN-indexed, the call's question becomes an OR of its discriminating words (stemmed; those
in at most half of the memory's facts: words every fact shares would bring in facts about other
things), and the facts rank by `ts_rank_cd`. Chosen over an embedding model because it needs nothing beyond the database
every install already has, is exact about the names, ids and numbers that facts in agent traffic are made
of (an embedding of "port 8443" is close to "port 8080"), and costs one query per user turn (about 6 ms
added at 2,000 facts: docs/benchmarks.md); its limit is synonyms ("car" does not find "vehicle").

Only a call whose last message is the user's searches memory (a tool result continues the same question),
and the facts go in front of that message's text: the new turn, so a continuation's earlier tokens are
unchanged (proxy.tito) and every chat template and provider accepts it.
"""

from __future__ import annotations

import re
from typing import Any

MAX_TERMS = 32
_WORD = re.compile(r"[^\W_]{2,}", re.UNICODE)
HEADER = "Facts from memory (use them where they answer the question):"


def question_text(body: dict[str, Any]) -> str | None:
    """The text of the call's last message when it is the user's, else None (no search)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return None


def query_terms(text: str) -> list[str]:
    """The words of a question, lower-cased, once each, in order: letters and digits only, so the
    search's text-search query built from them can never be a syntax error."""
    seen: dict[str, None] = {}
    for w in _WORD.findall(text.lower()):
        seen.setdefault(w, None)
        if len(seen) >= MAX_TERMS:
            break
    return list(seen)


def with_facts(body: dict[str, Any], facts: list[str]) -> dict[str, Any]:
    """The body with the facts in front of the last (user) message's text; `body` is left as it was."""
    if not facts:
        return body
    block = HEADER + "\n" + "\n".join(f"- {f}" for f in facts)
    messages = list(body["messages"])
    last = messages[-1]
    content = last.get("content")
    if isinstance(content, list):
        new_content: Any = [{"type": "text", "text": block}, *content]
    else:
        new_content = f"{block}\n\n{content or ''}"
    messages[-1] = {**last, "content": new_content}
    return {**body, "messages": messages}
