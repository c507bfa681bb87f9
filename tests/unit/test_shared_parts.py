"""A system prompt or tool list an agent resends is held as one object across its steps
(`capture.shared`): a batch to the writer carries it once, and the writer hashes it once."""

from __future__ import annotations

import pickle

import orjson
import pytest

from proxy.record import capture
from proxy.record.capture import _deep_size, _repeated_size, shared
from tests.redaction_corpus import client_operator_content


@pytest.fixture(autouse=True)
def _empty_cache():
    capture._REPEATED.clear()
    capture._REPEATED_IDS.clear()
    capture._repeated_held[0] = 0
    yield


def _parsed(part):
    return orjson.loads(orjson.dumps(part))  # as a new call parses it


def test_equal_parts_become_one_object_and_different_ones_do_not() -> None:
    tools = client_operator_content()["hermes"]["tools"]
    first, again = _parsed(tools), _parsed(tools)
    assert shared(first) is first and shared(again) is first
    changed = _parsed(tools)
    changed[0]["function"]["description"] += " (v2)"
    assert shared(changed) is changed
    assert shared(None) is None and shared([]) == []
    odd = {"set": {1, 2}}  # not JSON: kept as it is
    assert shared(odd) is odd


def test_a_hash_collision_does_not_swap_one_part_for_another() -> None:
    a, b = [{"name": "a"}], [{"name": "b"}]
    assert shared(a) is a
    # As if a's JSON hashed like b's: a's entry under b's key.
    capture._REPEATED[hash(orjson.dumps(b))] = capture._REPEATED.pop(hash(orjson.dumps(a)))
    assert shared(_parsed(b)) is not a
    assert shared(_parsed(b)) == b
    assert id(a) not in capture._REPEATED_IDS  # the forgotten part no longer counts as shared
    assert capture._repeated_held[0] == sum(size + len(raw) for raw, _, size in capture._REPEATED.values())


def test_the_cache_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr(capture, "_REPEATED_LIMIT", (4, 10**9))
    parts = [[{"n": i}] for i in range(10)]
    for p in parts:
        shared(p)
    assert len(capture._REPEATED) <= 4 and len(capture._REPEATED_IDS) == len(capture._REPEATED)
    monkeypatch.setattr(capture, "_REPEATED_LIMIT", (1000, 2_000))
    for i in range(50):
        shared([{"text": "x" * 100, "i": i}])
    assert capture._repeated_held[0] <= 2_000


def test_sizes_are_the_walks_whether_shared_or_not() -> None:
    for content in client_operator_content().values():
        for part in (content["tools"], content["system"]):
            first, again = _parsed(part), _parsed(part)
            assert _repeated_size(first) == _repeated_size(shared(again)) == _repeated_size(again) == _deep_size(first)


def test_a_batch_of_steps_carries_a_shared_part_once() -> None:
    tools = client_operator_content()["claude-code"]["tools"]
    one = len(pickle.dumps(_parsed(tools)))
    alone = len(pickle.dumps([{"tools": _parsed(tools)} for _ in range(20)]))
    held = len(pickle.dumps([{"tools": shared(_parsed(tools))} for _ in range(20)]))
    assert alone > 19 * one and held < 1.1 * one
    steps = pickle.loads(pickle.dumps([{"tools": shared(_parsed(tools))} for _ in range(3)]))
    assert steps[0]["tools"] is steps[1]["tools"] is steps[2]["tools"]  # one object in the writer too


def test_the_writer_records_shared_parts_as_it_records_separate_ones(monkeypatch) -> None:
    from proxy.governance.redaction import RedactionConfig, Redactor
    from proxy.record import prepare as prep
    from tests.unit.test_prepare_redaction import preparer, step

    redactor = Redactor(RedactionConfig(salt=b"t"))
    hermes = client_operator_content()["hermes"]
    system = {"role": "system", "content": hermes["system"][0]["content"] + " Reach me at maria@example.com."}

    def steps(share):
        pick = shared if share else (lambda p: p)
        return [step(messages=[{"role": "user", "content": f"turn {i}"}], system=pick(_parsed(system)),
                     tools=pick(_parsed(hermes["tools"])), prompt=f"turn {i}") for i in range(4)]

    hashes = []
    real_keyed = prep.keyed
    monkeypatch.setattr(prep, "keyed", lambda secret, value: hashes.append(1) or real_keyed(secret, value))
    alone = preparer(redactor).prepare(steps(False))
    n_alone, hashes[:] = len(hashes), []
    together = preparer(redactor).prepare(steps(True))
    assert len(hashes) == n_alone - 2 * 3  # the system prompt and the tools once, not once per step

    def view(rec):
        return (rec.system_hash, rec.tools_hash, rec.redaction, sorted((c.hash, c.kind, orjson.dumps(c.body))
                                                                      for c in rec.contents))

    assert [view(r) for r in together] == [view(r) for r in alone]
    assert together[0].redaction.get("EMAIL_ADDRESS") == 1 and together[0].contents


def test_a_tool_result_is_hashed_once_though_its_tool_message_holds_it_too(monkeypatch) -> None:
    """A tool result's text is its own content and, as a long text, its tool message's reference: one
    serialisation and one keyed hash of that string for the batch, and the same rows either way."""
    from dataclasses import replace

    from proxy.governance.redaction import RedactionConfig, Redactor
    from proxy.record import prepare as prep
    from proxy.record.capture import ToolResultIn
    from proxy.store.texts import MIN_CHARS, REF
    from tests.unit.test_prepare_redaction import preparer, step

    result = "line of build output, nothing secret in it\n" * (MIN_CHARS // 20)
    calls: list[object] = []
    real_keyed = prep.keyed
    monkeypatch.setattr(prep, "keyed", lambda secret, value: calls.append(value) or real_keyed(secret, value))

    def batch(same_object: bool):
        text = result if same_object else "".join(list(result))  # equal, another object
        msg = {"role": "tool", "tool_call_id": "c1", "content": text}
        st = replace(step(messages=[msg], prompt="x"), tool_results=[ToolResultIn(call_id="c1", content=result)])
        calls.clear()
        [rec] = preparer(Redactor(RedactionConfig(salt=b"t"))).prepare([st])
        return rec, sum(1 for v in calls if v == result)

    once, n_once = batch(True)
    twice, n_twice = batch(False)
    assert (n_once, n_twice) == (1, 2)
    rows = sorted((c.hash, c.kind, orjson.dumps(c.body), c.size) for c in once.contents)
    assert rows == sorted((c.hash, c.kind, orjson.dumps(c.body), c.size) for c in twice.contents)
    [message] = [c for c in once.contents if c.kind == "message"]
    [tool_result] = [c for c in once.contents if c.kind == "tool_result"]
    assert message.body["content"] == REF + tool_result.hash and tool_result.size == len(orjson.dumps(result))
