"""Which session a call belongs to, and which earlier step it continues.

Order: `X-ATDP-Session-Id`; the `/s/{id}/v1/...` path; client-native ids (Claude Code
`X-Claude-Code-Session-Id`, Codex `session-id`, Anthropic `metadata.user_id` JSON with
`session_id`, Responses `client_metadata.session_id`); else *continuation*: a call whose messages
start with an earlier step's input + output joins that step's session as its child.

Continuation uses rolling hashes of normalised messages ("match keys"), so finding the parent is
O(messages) dict lookups in memory. The hashes are seeded by the tenant, the API key and the end
user the call names (`link_seed`): calls of different keys or end users never link. Several proxies
on one database share the keys through `continuation_links` (proxy.store.links): a call whose parent
this proxy's memory does not know is looked up there once (`ContinuationIndex.learn`), and a call the
memory links costs no query.

A call with no parent that repeats an earlier call's request (same body, same key: `body_hash`) is a
*retry* of it, and joins its session as a sibling (same parent), only when
- the earlier call delivered no answer (it failed, or the client cut its stream off) and ended
  within the retry window (`ATDP_RETRY_WINDOW_S`, 30 s), or
- the client says it is a retry (`retry_signal`: `x-stainless-retry-count` above 0, as the OpenAI
  and Anthropic SDKs send on their retries, or an `Idempotency-Key`, which the fingerprint includes)
  and the earlier call is still running, or ended within the window.
Otherwise it is a new run: independent runs often open with the same words, and parallel samples
share a session only when the client names one.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
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


IDEMPOTENCY_HEADER = "idempotency-key"


def retry_signal(headers: Mapping[str, str]) -> bool:
    """Whether the client says the call is a retry of an earlier one: its SDK's retry counter
    (`x-stainless-retry-count`, "0" on a first attempt) or an idempotency key (the same key again
    means the same request; `body_hash` includes it)."""
    if headers.get(IDEMPOTENCY_HEADER):
        return True
    count = headers.get("x-stainless-retry-count", "").strip()
    return count.isdigit() and int(count) > 0


def end_user(body: dict[str, Any]) -> str:
    """The end user a call names: OpenAI `user` (or its successor `safety_identifier`), Anthropic
    `metadata.user_id`; "" when none."""
    meta = body.get("metadata")
    named = [body.get("user"), body.get("safety_identifier"), meta.get("user_id") if isinstance(meta, dict) else None]
    return "\x00".join(v for v in named if isinstance(v, str) and v)


def link_seed(tenant: str, caller: str, body: dict[str, Any]) -> str:
    """What a call's continuation keys and fingerprint are seeded with: its tenant, its API key
    (`Principal.actor`) and its end user. Calls that differ in any of them never link."""
    return f"{tenant}\x00{caller}\x00{end_user(body)}"


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


def prefix_hashes(seed: str, keys: list[bytes], start: str | None = None) -> list[str]:
    """h[i] = rolling hash of keys[:i+1], seeded by `seed` (a tenant, or `link_seed`: calls of other
    seeds never link); `start` continues an earlier sequence's last hash."""
    sha = hashlib.sha256
    h = start or sha(seed.encode()).hexdigest()
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


class Outcome(IntEnum):
    """What became of a call a later identical request may retry (`ContinuationIndex` inputs)."""

    running = 0  # not answered yet (a client that timed out may retry it)
    delivered = 1  # answered
    failed = 2  # no answer delivered: an error, or a stream the client cut off
    learned = 3  # another proxy's (proxy.store.links), which does not say: taken as delivered


# A request a later one may retry: (_pack(when it began or ended, the call), _pack(0, its parent),
# its history length, its Outcome).
_Input = tuple[bytes, bytes, int, int]


class ContinuationIndex:
    """Recent steps by the hash of (their input + their output), bounded by count and age; and the
    requests a retry may repeat, by their fingerprint (`body_hash`).

    Compact (16-byte keys, packed values): the map is the largest thing a proxy keeps. Requests serve
    only retries, so ended ones are kept for the retry window alone; running ones until they end."""

    def __init__(self, max_entries: int = 50_000, ttl_s: float = 24 * 3600.0, retry_window_s: float = 30.0) -> None:
        self._by_transcript: OrderedDict[bytes, bytes] = OrderedDict()  # key -> _pack(when, link)
        self._running: OrderedDict[bytes, _Input] = OrderedDict()  # fingerprint -> the latest such call running
        self._by_input: OrderedDict[bytes, _Input] = OrderedDict()  # fingerprint -> the latest such call ended
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.retry_window_s = retry_window_s

    def __len__(self) -> int:
        return len(self._by_transcript) + len(self._running) + len(self._by_input)

    def sizes(self) -> dict[str, int]:
        return {"continuations": len(self._by_transcript), "retry_inputs": len(self._by_input),
                "running_inputs": len(self._running)}

    def _trim(self, d: OrderedDict, max_age: float) -> None:
        oldest = time.monotonic() - max_age
        while d and (len(d) > self.max_entries or _WHEN.unpack_from(_first(next(iter(d.values()))))[0] < oldest):
            d.popitem(last=False)

    def add(self, transcript_hash: str, link: StepLink) -> None:
        key = _digest(transcript_hash)
        self._by_transcript[key] = _pack(time.monotonic(), link)
        self._by_transcript.move_to_end(key)
        self._trim(self._by_transcript, self.ttl_s)

    def begin_input(self, fingerprint: str, link: StepLink, parent: StepLink | None, history_len: int) -> None:
        """A call began: a retry the client sends while it runs (it timed out) may join it. Bounded
        by count and the session window, for a call that never ends (its task cancelled)."""
        key = _digest(fingerprint)
        self._running[key] = (_pack(time.monotonic(), link), _pack(0.0, parent), history_len, Outcome.running)
        self._running.move_to_end(key)
        self._trim(self._running, self.ttl_s)

    def end_input(self, fingerprint: str, link: StepLink, parent: StepLink | None, history_len: int,
                  delivered: bool) -> None:
        """A call ended, answered (`delivered`) or not; kept for the retry window."""
        key = _digest(fingerprint)
        running = self._running.get(key)
        if running is not None and _link(running[0]).step_id == link.step_id:
            del self._running[key]
        outcome = Outcome.delivered if delivered else Outcome.failed
        self._put_input(key, (_pack(time.monotonic(), link), _pack(0.0, parent), history_len, outcome))

    def _put_input(self, key: bytes, entry: _Input) -> None:
        self._by_input[key] = entry
        self._by_input.move_to_end(key)
        self._trim(self._by_input, min(self.ttl_s, self.retry_window_s))

    def forget(self, step_ids: set[str]) -> int:
        """Drop every entry of the forgotten steps: no later call is linked to a forgotten session."""
        n = 0
        for key in [k for k, v in self._by_transcript.items() if _link(v).step_id in step_ids]:
            del self._by_transcript[key]
            n += 1
        for d in (self._running, self._by_input):
            for key in [k for k, (v, p, _, _) in d.items()
                        if _link(v).step_id in step_ids or ((pl := _unpack(p)[1]) is not None and pl.step_id in step_ids)]:
                del d[key]
                n += 1
        return n

    def learn(self, rows: list[LinkRow]) -> None:
        """Keys another proxy published (proxy.store.links); what this memory already holds wins."""
        now = time.monotonic()
        for r in rows:
            link = StepLink(step_id=r.step_id, session_id=r.session_id)
            key = _digest(r.hash)
            if r.kind == "t" and key not in self._by_transcript:
                self.add(r.hash, link)
            elif r.kind == "i" and key not in self._by_input and key not in self._running:
                parent = StepLink(step_id=r.parent_step_id, session_id=r.session_id) if r.parent_step_id else None
                # Dated when the other proxy's call ended: the retry window counts from then.
                self._put_input(key, (_pack(now - r.age_s, link), _pack(0.0, parent), r.history_len, Outcome.learned))

    def find(self, hashes: list[str], session_id: str | None, fingerprint: str = "", retry: bool = False
             ) -> Continuation:
        """The longest earlier transcript that is a strict prefix of this call's messages; else, for
        a retry of an earlier request (module docstring), that request's parent and session."""
        now = time.monotonic()
        for i in range(len(hashes) - 2, -1, -1):
            hit = self._by_transcript.get(_digest(hashes[i]))
            if hit is None:
                continue
            when, link = _unpack(hit)
            if link is not None and when >= now - self.ttl_s and (session_id is None or link.session_id == session_id):
                return Continuation(parent=link, history_len=i + 1)
        if fingerprint:
            key = _digest(fingerprint)
            for entry in (self._running.get(key), self._by_input.get(key)):
                if entry is None or not (retry or entry[3] == Outcome.failed):
                    continue  # an answered request again, unasked: a new run
                when, link = _unpack(entry[0])
                if link is None or (entry[3] != Outcome.running and when < now - self.retry_window_s):
                    continue
                if session_id is not None and link.session_id != session_id:
                    continue
                parent = _unpack(entry[1])[1]
                if parent is not None:
                    return Continuation(parent=parent, history_len=entry[2])
                return Continuation(parent=StepLink(step_id="", session_id=link.session_id), history_len=0)
        return Continuation(parent=None, history_len=0)


def _first(v: bytes | tuple[bytes, ...]) -> bytes:
    return v if isinstance(v, bytes) else v[0]


def _link(v: bytes) -> StepLink:
    link = _unpack(v)[1]
    assert link is not None  # entries always name their step
    return link


def unknown_keys(cont: Continuation, session: SessionRef, hashes: list[str], messages: list[Any], *,
                 inputs: bool = True, retry_key: str | None = None) -> list[str]:
    """The keys to ask the database for; [] when memory already has the answer.

    Nothing known: the keys that end with a model output (a stored step's transcript always does;
    a first call costs no read), and `retry_key` (a retry's fingerprint: the request it repeats
    may have run on another proxy) where the database holds requests too (`inputs`: the shared
    keys). A parent known: only when a model output comes after it in the history, i.e. a later
    turn this proxy did not serve may be the real parent; a client's usual next call (outputs,
    then its tool results or a user turn) costs no query."""
    if cont.parent is None and session.source != "continuation":  # (a sibling of a first step: known)
        wanted = [retry_key] if inputs and retry_key else []
        return wanted + [hashes[j] for j in range(len(hashes) - 1) if is_output(messages[j])]
    return [hashes[j] for j in range(cont.history_len, len(hashes) - 1) if is_output(messages[j])]


def is_output(message: Any) -> bool:
    return isinstance(message, dict) and (message.get("role") == "assistant"
                                          or message.get("type") in ("function_call", "reasoning"))


def body_hash(seed: str, raw_body: bytes, idempotency_key: str = "") -> str:
    """A request's fingerprint, for telling a retry from a new run: a retry re-sends the same bytes
    with the same key (`seed`: `link_seed`) and idempotency key. Of the bytes as sent, not
    re-serialised (an agent's body is tens of KB)."""
    h = hashlib.sha256(seed.encode())
    h.update(b"\0")
    h.update(idempotency_key.encode())
    h.update(b"\0")
    h.update(raw_body)
    return h.hexdigest()


def resolve(
    *, tenant: str, headers: Mapping[str, str], path_session: str | None, body: dict[str, Any], hashes: list[str],
    index: ContinuationIndex, fingerprint: str = "", retry: bool = False,
) -> tuple[SessionRef, Continuation]:
    """The call's session and parent; `fingerprint` and `retry` (`body_hash`, `retry_signal`) tell
    a retry of an earlier request from a new run."""
    client = detect_client(headers)
    task_id = headers.get("x-atdp-task-id")
    if task_id is not None and (problem := id_problem(task_id)):
        raise ApiError(400, f"X-ATDP-Task-Id {problem}", param="X-ATDP-Task-Id")
    named = explicit_session(headers, path_session, body)
    if named:
        sid, source = named
        cont = index.find(hashes, sid, fingerprint, retry)
        return SessionRef(tenant, sid, source, client, task_id), cont
    cont = index.find(hashes, None, fingerprint, retry)
    if cont.parent is not None:
        ref = SessionRef(tenant, cont.parent.session_id, "continuation", client, task_id)
        if not cont.parent.step_id:  # sibling of a session's first step: same session, no parent
            cont = Continuation(parent=None, history_len=0)
        return ref, cont
    return SessionRef(tenant, new_id(), "new", client, task_id), cont
