"""Which session a call belongs to, and which earlier step it continues.

Order: `X-ATDP-Session-Id`; the `/s/{id}/v1/...` path; client-native ids (Claude Code
`X-Claude-Code-Session-Id`, Codex `session-id`, Anthropic `metadata.user_id` JSON with
`session_id`, Responses `client_metadata.session_id`); else *continuation*: a call whose messages
start with an earlier step's input + output joins that step's session as its child.

Continuation uses rolling hashes of normalised messages ("match keys"), so finding the parent is
O(messages) dict lookups in memory. Several proxies on one database share the keys through
`continuation_links` (proxy.store.links): a call whose parent this proxy's memory does not know is
looked up there once (`ContinuationIndex.learn`), and a call the memory links costs no query. A call whose input
equals an earlier call's is linked to it (a sibling: a retry, or a parallel sample) only when the
whole request body is identical and the earlier call ended within the retry window (30 s by
default): two independent runs that open with the same system prompt and first message are two
sessions.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.errors import ApiError
from proxy.record.capture import SessionRef
from proxy.shapes import id_problem, session_id_problem
from proxy.store.ids import new_id, uuid_bytes, uuid_text
from proxy.store.links import LinkRow


@dataclass(frozen=True)
class StepLink:
    step_id: str
    session_id: str  # external id


@dataclass
class Continuation:
    parent: StepLink | None
    history_len: int  # how many leading messages the parent already covers


def detect_client(headers: Mapping[str, str]) -> str | None:
    ua = (headers.get("user-agent") or "").lower()
    if headers.get("x-claude-code-session-id") or "claude-cli" in ua or "claude-code" in ua:
        return "claude-code"
    if headers.get("session-id") and ("codex" in ua or headers.get("originator", "").startswith("codex")):
        return "codex"
    if "codex" in ua:
        return "codex"
    if "hermes" in ua:
        return "hermes"
    if "anthropic" in ua:
        return "anthropic-python" if "python" in ua else "anthropic-sdk"
    if ua.startswith("openai/python") or "openai/python" in ua:
        return "openai-python"
    if "openai" in ua:
        return "openai-sdk"
    return ua.split("/")[0][:64] or None


def _metadata_session(body: dict[str, Any]) -> str | None:
    meta = body.get("metadata")
    if isinstance(meta, dict):
        uid = meta.get("user_id")
        if isinstance(uid, str) and "session" in uid:
            try:
                parsed = orjson.loads(uid)
            except orjson.JSONDecodeError:
                # Older Claude Code: "user_<hash>_account_<id>_session_<uuid>"
                _, _, tail = uid.rpartition("_session_")
                return tail or None
            if isinstance(parsed, dict) and parsed.get("session_id"):
                return str(parsed["session_id"])
    cm = body.get("client_metadata")
    if isinstance(cm, dict) and cm.get("session_id"):
        return str(cm["session_id"])
    return None


def explicit_session(headers: Mapping[str, str], path_session: str | None, body: dict[str, Any]) -> tuple[str, str] | None:
    """(session id, how we know it) from headers, the path or the body; None when the call names none.

    Every id the call names is checked, used or not (a 400 naming where it came from, never its value):
    the store could not hold an over-long id or one with a NUL, and the client would get 200 for a
    step that is never stored."""
    named = [
        ("header", "X-ATDP-Session-Id", headers.get("x-atdp-session-id")),
        ("path", "the /s/{session_id} path", path_session),
        ("claude-code", "X-Claude-Code-Session-Id", headers.get("x-claude-code-session-id")),
        ("codex", "session-id", headers.get("session-id")),
        ("metadata", "the session_id in metadata", _metadata_session(body)),
    ]
    for _, where, value in named:
        if value and (problem := session_id_problem(value)):
            raise ApiError(400, f"session id ({where}) {problem}", param=where)
    for source, _, value in named:
        if value:
            return value, source
    return None


# --- match keys: what must be equal for a message to count as "the same" --------------------------

_COSMETIC = frozenset({"cache_control", "citations", "annotations", "logprobs", "id", "status"})


def _text_of(content: Any) -> Any:
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict):
                if part.get("type") in ("thinking", "redacted_thinking"):
                    continue  # like `reasoning` items: clients may clear or re-sign them; never in the prompt
                # Cosmetic keys, and keys a client's SDK echoes back as null (`caller`, `citations`).
                p = {k: v for k, v in part.items() if v is not None and k not in _COSMETIC}
                if "text" in p and isinstance(p["text"], str):
                    p["text"] = p["text"].strip()
                # input_text / output_text / text are the same words in different wrappers.
                if p.get("type") in ("input_text", "output_text"):
                    p["type"] = "text"
                if p.get("type") == "text" and set(p) == {"type", "text"}:
                    out.append(p["text"])
                    continue
                out.append(p)
            else:
                out.append(part)
        if all(isinstance(x, str) for x in out):
            return "\n".join(out)
        return out
    return content


def _args(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def match_key(message: dict[str, Any]) -> bytes:
    """A normal form of one message/item, independent of the API's cosmetic differences."""
    if not isinstance(message, dict):
        return orjson.dumps(message, option=orjson.OPT_SORT_KEYS)
    mtype = message.get("type")
    if mtype == "function_call":  # Responses item
        key: dict[str, Any] = {"fc": message.get("call_id"), "n": message.get("name"), "a": _args(message.get("arguments"))}
    elif mtype == "function_call_output":
        key = {"fo": message.get("call_id"), "o": _text_of(message.get("output"))}
    elif mtype == "reasoning":
        key = {"r": 1}
    else:
        key = {"role": message.get("role") or "user", "c": _text_of(message.get("content"))}
        if message.get("tool_calls"):
            key["tc"] = [
                {"id": tc.get("id"), "n": (tc.get("function") or {}).get("name"), "a": _args((tc.get("function") or {}).get("arguments"))}
                for tc in message["tool_calls"]
            ]
        if message.get("tool_call_id"):
            key["tid"] = message["tool_call_id"]
    return orjson.dumps(key, option=orjson.OPT_SORT_KEYS)


def prefix_hashes(tenant: str, keys: list[bytes], start: str | None = None) -> list[str]:
    """h[i] = rolling hash of keys[:i+1], seeded by the tenant (tenants never link to each other);
    `start` continues an earlier sequence's last hash."""
    sha = hashlib.sha256
    h = start or sha(tenant.encode()).hexdigest()
    out: list[str] = []
    append = out.append
    for k in keys:  # chain_hash(h, sha256(k)), inline: two hashes per message of every call's history
        h = sha(f"{h}:{sha(k).hexdigest()}".encode()).hexdigest()
        append(h)
    return out


def _digest(h: str) -> bytes:
    """A match key as 16 bytes: the hex hashes are 64 characters (113 bytes as a str); 128 bits do
    not collide among the few hundred thousand keys a proxy holds."""
    try:
        return bytes.fromhex(h[:32])
    except ValueError:  # not hex (not one of ours): still a stable 16-byte key
        return hashlib.blake2b(h.encode(), digest_size=16).digest()


def _pack(when: float, link: StepLink | None) -> bytes:
    """(when, link) as one bytes object: two UUIDs as 32 bytes, other ids as text. An entry so costs
    about 230 bytes with its key and the map's own, against about 960 as dataclasses and hex strings."""
    head = _WHEN.pack(when)
    if link is None:
        return head
    step, session = uuid_bytes(link.step_id), uuid_bytes(link.session_id)
    if step is not None and session is not None:
        return head + b"\x01" + step + session
    # Step ids are ours (no NUL); the session id is whatever follows the first NUL.
    return head + b"\x00" + link.step_id.encode() + b"\x00" + link.session_id.encode()


def _unpack(v: bytes) -> tuple[float, StepLink | None]:
    when = _WHEN.unpack_from(v)[0]
    if len(v) == _WHEN.size:
        return when, None
    if v[_WHEN.size] == 1:
        o = _WHEN.size + 1
        return when, StepLink(uuid_text(int.from_bytes(v[o : o + 16], "big")),
                              uuid_text(int.from_bytes(v[o + 16 : o + 32], "big")))
    step, _, session = v[_WHEN.size + 1 :].partition(b"\x00")
    return when, StepLink(step.decode(), session.decode())


_WHEN = struct.Struct("d")


class ContinuationIndex:
    """Recent steps by the hash of (their input + their output), bounded by count and age.

    Compact (16-byte keys, packed values): the map is the largest thing a proxy keeps. Inputs serve
    only retries, so they are kept for the retry window alone."""

    def __init__(self, max_entries: int = 50_000, ttl_s: float = 24 * 3600.0, retry_window_s: float = 30.0) -> None:
        self._by_transcript: OrderedDict[bytes, bytes] = OrderedDict()  # key -> _pack(when, link)
        # input key -> (when it ended, the call, its parent, history length, its body's 16-byte hash)
        self._by_input: OrderedDict[bytes, tuple[bytes, bytes, int, bytes]] = OrderedDict()
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.retry_window_s = retry_window_s

    def __len__(self) -> int:
        return len(self._by_transcript) + len(self._by_input)

    def sizes(self) -> dict[str, int]:
        return {"continuations": len(self._by_transcript), "retry_inputs": len(self._by_input)}

    def _trim(self, d: OrderedDict, max_age: float) -> None:
        oldest = time.monotonic() - max_age
        while d and (len(d) > self.max_entries or _WHEN.unpack_from(_first(next(iter(d.values()))))[0] < oldest):
            d.popitem(last=False)

    def add(self, transcript_hash: str, link: StepLink) -> None:
        key = _digest(transcript_hash)
        self._by_transcript[key] = _pack(time.monotonic(), link)
        self._by_transcript.move_to_end(key)
        self._trim(self._by_transcript, self.ttl_s)

    def add_input(self, input_hash: str, link: StepLink, parent: StepLink | None, history_len: int,
                  body_hash: str = "") -> None:
        key = _digest(input_hash)
        self._by_input[key] = (_pack(time.monotonic(), link), _pack(0.0, parent), history_len,
                               _digest(body_hash) if body_hash else b"")
        self._by_input.move_to_end(key)
        self._trim(self._by_input, min(self.ttl_s, self.retry_window_s))

    def forget(self, step_ids: set[str]) -> int:
        """Drop every entry of the forgotten steps: no later call is linked to a forgotten session."""
        n = 0
        for key in [k for k, v in self._by_transcript.items() if _link(v).step_id in step_ids]:
            del self._by_transcript[key]
            n += 1
        for key in [k for k, (v, p, _, _) in self._by_input.items()
                    if _link(v).step_id in step_ids or ((pl := _unpack(p)[1]) is not None and pl.step_id in step_ids)]:
            del self._by_input[key]
            n += 1
        return n

    def learn(self, rows: list[LinkRow]) -> None:
        """Keys another proxy published (proxy.store.links); what this memory already holds wins."""
        for r in rows:
            link = StepLink(step_id=r.step_id, session_id=r.session_id)
            if r.kind == "t" and _digest(r.hash) not in self._by_transcript:
                self.add(r.hash, link)
            elif r.kind == "i" and _digest(r.hash) not in self._by_input:
                parent = StepLink(step_id=r.parent_step_id, session_id=r.session_id) if r.parent_step_id else None
                self.add_input(r.hash, link, parent, r.history_len)

    def find(self, hashes: list[str], session_id: str | None, body_hash: str = "") -> Continuation:
        """The longest earlier transcript that is a strict prefix of this call's messages."""
        now = time.monotonic()
        for i in range(len(hashes) - 2, -1, -1):
            hit = self._by_transcript.get(_digest(hashes[i]))
            if hit is None:
                continue
            when, link = _unpack(hit)
            if link is not None and when >= now - self.ttl_s and (session_id is None or link.session_id == session_id):
                return Continuation(parent=link, history_len=i + 1)
        if hashes and body_hash:
            # The same request again soon after (a retry, or a parallel sample): a sibling of that
            # step. Same input alone is not enough: independent runs often open identically.
            hit2 = self._by_input.get(_digest(hashes[-1]))
            if hit2 is not None and hit2[3] == _digest(body_hash):
                when, link = _unpack(hit2[0])
                parent = _unpack(hit2[1])[1]
                if (link is not None and when >= now - self.retry_window_s
                        and (session_id is None or link.session_id == session_id)):
                    if parent is not None:
                        return Continuation(parent=parent, history_len=hit2[2])
                    return Continuation(parent=StepLink(step_id="", session_id=link.session_id), history_len=0)
        return Continuation(parent=None, history_len=0)


def _first(v: bytes | tuple[bytes, ...]) -> bytes:
    return v if isinstance(v, bytes) else v[0]


def _link(v: bytes) -> StepLink:
    link = _unpack(v)[1]
    assert link is not None  # entries always name their step
    return link


def unknown_keys(cont: Continuation, session: SessionRef, hashes: list[str], messages: list[Any], *,
                  inputs: bool = True) -> list[str]:
    """The keys to ask the database for; [] when memory already has the answer.

    Nothing known: when the history holds a model output (a first call costs no read), every key
    where the database holds inputs too (`inputs`: the shared keys, whose input keys find a retry
    another proxy served), else the keys that end with a model output (a stored step's transcript
    always does). A parent known: only when a model output comes after it in the history, i.e. a
    later turn this proxy did not serve may be the real parent; a client's usual next call
    (outputs, then its tool results or a user turn) costs no query."""
    if cont.parent is None and session.source != "continuation":  # (a sibling of a first step: known)
        # Every stored transcript ends with a model output: a call with none in its history can
        # only be a retry of a first call, which is not worth a read on every first call.
        if not any(is_output(m) for m in messages[:-1]):
            return []
        return hashes if inputs else [hashes[j] for j in range(len(hashes) - 1) if is_output(messages[j])]
    return [hashes[j] for j in range(cont.history_len, len(hashes) - 1) if is_output(messages[j])]


def is_output(message: Any) -> bool:
    return isinstance(message, dict) and (message.get("role") == "assistant"
                                          or message.get("type") in ("function_call", "reasoning"))


def body_hash(tenant: str, raw_body: bytes) -> str:
    """A request body's fingerprint (per tenant), for telling a retry from a new run: a retry re-sends
    the same bytes. Of the bytes as sent, not re-serialised (an agent's body is tens of KB); it lives
    in one proxy's memory only (`ContinuationIndex`), so no stored key changes with it."""
    h = hashlib.sha256(tenant.encode())
    h.update(b"\0")
    h.update(raw_body)
    return h.hexdigest()


def resolve(
    *, tenant: str, headers: Mapping[str, str], path_session: str | None, body: dict[str, Any], hashes: list[str],
    index: ContinuationIndex, fingerprint: str = "",
) -> tuple[SessionRef, Continuation]:
    client = detect_client(headers)
    task_id = headers.get("x-atdp-task-id")
    if task_id is not None and (problem := id_problem(task_id)):
        raise ApiError(400, f"X-ATDP-Task-Id {problem}", param="X-ATDP-Task-Id")
    named = explicit_session(headers, path_session, body)
    if named:
        sid, source = named
        cont = index.find(hashes, sid, fingerprint)
        return SessionRef(tenant, sid, source, client, task_id), cont
    cont = index.find(hashes, None, fingerprint)
    if cont.parent is not None:
        ref = SessionRef(tenant, cont.parent.session_id, "continuation", client, task_id)
        if not cont.parent.step_id:  # sibling of a session's first step: same session, no parent
            cont = Continuation(parent=None, history_len=0)
        return ref, cont
    return SessionRef(tenant, new_id(), "new", client, task_id), cont
