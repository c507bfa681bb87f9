"""Token ids without PII.

Redaction cleans the stored *text*; token ids are the same text in another alphabet, so a step whose
prompt or output touched redacted text would leak it through its ids. The writer therefore hands
such steps to a token policy. Without a tokenizer (`token_policy` below) their ids are dropped and
the step becomes `audit_only`. With the model's tokenizer (`TokenGuard`) they are cleaned: every raw
value the redactor removed from the step's context is located in the decoded ids and the tokens
covering it are replaced by the tokenization of its placeholder. Prompt ids so rewritten make the step
`rederived`; rewritten output tokens are masked out of training (mask 0, logprob 0). When a value's
whereabouts are unknown (the history was redacted before a restart, the memory evicted it) or the
cleaned ids still show it, the ids are dropped. See atdp_schema/README.md, "Governance and token ids".
"""

from __future__ import annotations

import bisect
import json
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from atdp_schema.models import TokenSource
from proxy.lru import LRU
from proxy.store.tokens import step_versions

Found = tuple[tuple[str, str], ...]  # (raw value, its replacement) pairs; raw: memory only


class TokenCodec(Protocol):
    """What the guard needs from a tokenizer: the exact bytes of each id, and text -> ids."""

    name: str

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]: ...

    def encode(self, text: str) -> list[int]: ...


class ByteCodec:
    """A byte-level vocabulary: token id = one UTF-8 byte (the scripted test engine speaks this)."""

    name = "bytes"

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        return [bytes((i,)) for i in ids]

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def _bytes_to_unicode() -> dict[str, int]:
    # GPT-2's byte <-> printable-character table, which every byte-level BPE vocabulary uses.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class HFCodec:
    """A Hugging Face `tokenizers.Tokenizer`: byte-level BPE (GPT-2, Llama 3, Qwen) or SentencePiece-style
    vocabularies with byte fallback (Llama 2, Mistral). Special tokens decode to their literal text."""

    def __init__(self, tokenizer: Any, name: str = "tokenizer") -> None:
        self.tok = tokenizer
        self.name = name
        self.special = {i: t.content.encode() for i, t in tokenizer.get_added_tokens_decoder().items()}
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        self.byte_level = "ByteLevel" in kinds
        self._table = _bytes_to_unicode()
        self._cache: dict[int, bytes] = {}
        probe = "Hi Maria, mail maria.g@example.com\n\t{\"k\": [1, 2]} naïve ∑ 🙂 done."
        if b"".join(self.token_bytes(self.encode(probe))).lstrip(b" ") != probe.encode():
            raise ValueError(f"{name}: cannot map token ids to exact bytes (unsupported decoder {sorted(kinds)})")

    def _one(self, i: int) -> bytes:
        hit = self._cache.get(i)
        if hit is not None:
            return hit
        if i in self.special:
            out = self.special[i]
        else:
            piece = self.tok.id_to_token(i)
            if piece is None:
                raise ValueError(f"token id {i} is not in the vocabulary of {self.name}")
            if self.byte_level:
                out = bytes(self._table[c] for c in piece)
            elif m := _BYTE_FALLBACK.fullmatch(piece):
                out = bytes((int(m.group(1), 16),))
            else:
                out = piece.replace("▁", " ").encode()
        self._cache[i] = out
        return out

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        return [self._one(i) for i in ids]

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)


def find_tokenizer(root: str) -> str | None:
    """The tokenizer.json of the model an engine serves, from the `root` its /v1/models reports: a model
    folder this host can read (the same path, as on one machine or with a shared volume), or a hub id
    whose files are in the local Hugging Face cache. None when neither is here: never downloads."""
    path = Path(root).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.name == "tokenizer.json" and path.is_file():
        return str(path)
    if path.is_absolute() or root.count("/") != 1:
        return None  # a path this host cannot see, or not a hub id
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(root, "tokenizer.json")
    except Exception:  # a malformed id, an unreadable cache: no tokenizer, ids are dropped as before
        return None
    return cached if isinstance(cached, str) else None


def load_codec(spec: str | None) -> TokenCodec | None:
    """`ATDP_TOKENIZER`: a model folder or tokenizer.json (the served model's), or `bytes`. None: no codec."""
    if not spec or spec == "none":
        return None
    if spec == "bytes":
        return ByteCodec()
    from tokenizers import Tokenizer

    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    return HFCodec(Tokenizer.from_file(str(path)), name=str(path))


@dataclass
class TokenDecision:
    """What the writer stores for a step's tokens. `source`: engine (ids exactly as sampled), rederived
    (some ids re-tokenized from redacted text), dropped. `versions` and `logprobs` align with
    `output_ids`; `output_mask` (None: all 1) is 0 for output tokens that are not the engine's."""

    source: str
    prompt_ids: Sequence[int]  # lists, or the capture's machine arrays
    output_ids: Sequence[int]
    logprobs: Sequence[float]
    versions: list[str]
    output_mask: list[int] | None = None
    reason: str = ""

    @classmethod
    def dropped(cls, reason: str) -> TokenDecision:
        return cls(TokenSource.dropped, [], [], [], [], None, reason)


def token_policy(st: Any, *, prompt_dirty: bool, output_counts: dict[str, int], **_: Any) -> TokenDecision:
    """The policy without a tokenizer: ids that touched redacted text cannot be cleaned, so they go."""
    return TokenDecision.dropped("token ids touched redacted text and no tokenizer is configured")


def _variants(raw: str, replacement: str) -> list[tuple[bytes, bytes]]:
    """The forms a value takes in model-visible text: as is, and JSON-escaped (tool arguments rendered
    by a chat template, a JSON tool result)."""
    out = {raw.encode(): replacement.encode()}
    for ascii_only in (True, False):
        esc = json.dumps(raw, ensure_ascii=ascii_only)[1:-1].encode()
        out.setdefault(esc, json.dumps(replacement, ensure_ascii=ascii_only)[1:-1].encode())
    return [(k, v) for k, v in out.items() if k]


_NON_ALNUM = re.compile(r"[\W_]+")


def _core(text: str) -> str:
    return _NON_ALNUM.sub("", text).lower()


class TokenGuard:
    """The token policy with a tokenizer, and the in-memory record of what redaction removed.

    `remember(tenant, hash, found)` is called by the writer for each content it redacted, with the raw
    values found in it; `__call__` cleans one step's ids. Per step it keeps the values its context holds
    (its prompt's plus its output's) so a child step, whose prompt replays that context, can be cleaned
    too. Everything here is process memory, bounded, never written anywhere.
    """

    def __init__(self, codec: TokenCodec, *, max_contents: int = 500_000, max_steps: int = 200_000) -> None:
        self.codec = codec
        self._contents: LRU = LRU(max_contents)  # (tenant, content hash) -> Found
        self._steps: LRU = LRU(max_steps)  # step id -> Found of its whole context
        self._lock = threading.Lock()
        self.stats = {s.value: 0 for s in (TokenSource.engine, TokenSource.rederived, TokenSource.dropped)}

    # --- memory --------------------------------------------------------------------------------------

    def remember(self, tenant: str, content_hash: str, found: list[tuple[str, str]]) -> None:
        if found:
            with self._lock:
                self._contents.put((tenant, content_hash), tuple(dict.fromkeys(map(tuple, found))))

    def forget(self, tenant: str, *, content_hashes: Iterable[str] | None = None,
               step_ids: Iterable[str] = ()) -> None:
        """Drop remembered values (a forgotten session's, or all of a tenant's when hashes is None)."""
        with self._lock:
            if content_hashes is None:
                for key in [k for k in self._contents if k[0] == tenant]:
                    del self._contents[key]
            else:
                for h in content_hashes:
                    self._contents.pop((tenant, h), None)
            for sid in step_ids:
                self._steps.pop(sid, None)

    def _values_of(self, tenant: str, hashes: Iterable[str | None], counts_of: dict[str, dict]) -> set | None:
        out: set = set()
        for h in hashes:
            if not h or not any(counts_of.get(h, {}).values()):
                continue
            found = self._contents.get((tenant, h))
            if found is None:
                return None  # redacted, but what was removed is not in memory
            out.update(found)
        return out

    # --- the policy ----------------------------------------------------------------------------------

    def __call__(self, st: Any, *, prompt_dirty: bool, output_counts: dict[str, int], parent_dirty: bool = True,
                 refs: dict | None = None, counts_of: dict[str, dict] | None = None) -> TokenDecision:
        decision = self._decide(st, parent_dirty=parent_dirty, refs=refs or {}, counts_of=counts_of or {})
        self.stats[decision.source] = self.stats.get(decision.source, 0) + 1
        return decision

    def _decide(self, st: Any, *, parent_dirty: bool, refs: dict, counts_of: dict) -> TokenDecision:
        tenant = st.session.tenant
        with self._lock:
            values: set | None = set()
            if parent_dirty:
                parent = self._steps.get(st.parent_step_id) if st.parent_step_id else None
                values = None if parent is None else set(parent)
            if values is not None:
                new = self._values_of(tenant, [refs.get("system"), refs.get("tools"), *refs.get("messages", []),
                                               *refs.get("extras", []), refs.get("output")], counts_of)
                values = None if new is None else values | new
            if values is not None:
                self._steps.put(st.step_id, tuple(values))
        if values is None:
            return TokenDecision.dropped("the redacted values of this step's context are not in memory")
        version = st.model_version or "unknown"
        try:
            prompt, p_spans = self.clean(st.prompt_token_ids, values)
            output, o_spans = self.clean(st.output_token_ids, values)
            leaked = self.still_visible(prompt, values) or self.still_visible(output, values)
        except (ValueError, KeyError, UnicodeDecodeError) as e:
            return TokenDecision.dropped(f"token ids could not be decoded: {e}")
        if leaked:
            return TokenDecision.dropped("a redacted value is still visible in the decoded ids")
        logprobs = list(st.output_logprobs)
        versions = step_versions(len(st.output_token_ids), engine=getattr(st, "output_versions", None),
                                 window=getattr(st, "version_window", None), served=version)
        if not p_spans and not o_spans:
            return TokenDecision(TokenSource.engine, prompt, output, logprobs, versions, None)
        mask = [1] * len(st.output_token_ids) if o_spans else None
        # Splice masked placeholder tokens into the per-token arrays, right to left so offsets hold.
        for i, j, n in reversed(o_spans):
            v = versions[i] if i < len(versions) else version
            logprobs[i:j] = [0.0] * n
            versions[i:j] = [v] * n
            mask[i:j] = [0] * n
        return TokenDecision(TokenSource.rederived, prompt, output, logprobs, versions, mask)

    def clean(self, ids: Sequence[int], values: Iterable[tuple[str, str]]) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Replace every occurrence of a raw value in the decoded ids by its placeholder's tokens.

        Returns the new ids and, per rewritten run, (first old index, end old index, new token count),
        left to right.
        A run covers whole tokens: the bytes around the value inside its first and last token are kept
        and re-tokenized together with the placeholder.
        """
        ids = list(ids)
        if not ids:
            return ids, []
        pieces = self.codec.token_bytes(ids)
        data = b"".join(pieces)
        starts, pos = [], 0
        for p in pieces:
            starts.append(pos)
            pos += len(p)
        hits: list[tuple[int, int, bytes]] = []
        for raw, replacement in values:
            for needle, rep in _variants(raw, replacement):
                at = data.find(needle)
                while at >= 0:
                    hits.append((at, at + len(needle), rep))
                    at = data.find(needle, at + len(needle))
        if not hits:
            return ids, []
        # Merge overlapping hits (longest replacement wins), then group hits sharing tokens into runs.
        hits.sort(key=lambda h: (h[0], -(h[1] - h[0])))
        merged: list[list[Any]] = []
        for a, b, rep in hits:
            if merged and a < merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
                continue
            merged.append([a, b, rep])
        # Runs of whole tokens, widened to whole characters (a token may hold half of one), merged when
        # they touch.
        runs: list[list[Any]] = []  # [first token, last token, [(a, b, rep), ...]]
        for a, b, rep in merged:
            i = bisect.bisect_right(starts, a) - 1
            j = bisect.bisect_right(starts, b - 1) - 1
            while i > 0 and not _starts_char(data, starts[i]):
                i -= 1
            while j + 1 < len(ids) and not _starts_char(data, starts[j + 1]):
                j += 1
            if runs and i <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], j)
                runs[-1][2].append((a, b, rep))
            else:
                runs.append([i, j, [(a, b, rep)]])
        out: list[int] = []
        spans: list[tuple[int, int, int]] = []
        prev = 0
        for i, j, parts in runs:
            lo, hi = starts[i], starts[j] + len(pieces[j])
            seg, cur = bytearray(), lo
            for a, b, rep in parts:
                seg += data[cur:a] + rep
                cur = b
            seg += data[cur:hi]
            new = self.codec.encode(bytes(seg).decode())
            out.extend(ids[prev:i])
            out.extend(new)
            spans.append((i, j + 1, len(new)))
            prev = j + 1
        out.extend(ids[prev:])
        return out, spans

    def still_visible(self, ids: Sequence[int], values: Iterable[tuple[str, str]]) -> bool:
        """True when a value can still be read in the decoded ids: verbatim in any form, or its letters
        and digits in sequence (a template or tokenizer may re-punctuate it)."""
        if not ids:
            return False
        text = b"".join(self.codec.token_bytes(ids)).decode(errors="replace")
        core = _core(text)
        for raw, _ in values:
            if any(needle.decode(errors="replace") in text for needle, _ in _variants(raw, "")):
                return True
            c = _core(raw)
            if len(c) >= 6 and c in core:
                return True
        return False


def _starts_char(data: bytes, at: int) -> bool:
    return at >= len(data) or (data[at] & 0xC0) != 0x80
