"""The shadow gate's pure parts: judging a mirrored answer, the verdict, and which live calls a run takes."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from proxy.evaluation.cases import Answer
from proxy.evaluation.shadow import Arm, ShadowNumbers, mirrored, problems, verdict
from proxy.layers.serving import Applied, LayerVersion
from proxy.layers.shadow import ShadowRun
from proxy.store.canary import CanaryRef

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["unit"]}}}]
SCHEMAS = {"get_weather": TOOLS[0]["function"]["parameters"]}


def _call(name: str, args: object) -> Answer:
    return Answer(text="", tool_calls=[{"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}])


def test_an_answer_is_sound_when_its_calls_fit_the_declared_tools_and_it_was_not_cut():
    assert problems(Arm(_call("get_weather", {"unit": "celsius"})), SCHEMAS) == []
    assert problems(Arm(Answer(text="It is sunny.")), SCHEMAS) == []
    assert problems(Arm(_call("get_weather", {"unit": "Celsius"})), SCHEMAS)[0].startswith("get_weather.")
    assert problems(Arm(_call("get_weather", "{not json")), SCHEMAS) == ["get_weather.$: arguments are not valid JSON"]
    assert problems(Arm(_call("get_time", {})), SCHEMAS) == ["called a tool the request did not declare"]
    assert problems(Arm(_call("mail maria@example.com", {})), SCHEMAS) == ["called a tool the request did not declare"]
    # What the model wrote never reaches the gate's numbers: a key that is no identifier is shown as "?".
    notes = {"get_notes": {"type": "object", "additionalProperties": {"type": "integer"}}}
    assert problems(Arm(_call("get_notes", {"maria@example.com": "x", "n": "y"})), notes) == [
        "get_notes.?: type", "get_notes.$.n: type"]
    assert problems(Arm(Answer(text="It is", finish_reason="length")), SCHEMAS) == ["cut at max_tokens"]
    assert problems(Arm(None, 400), SCHEMAS) == ["answered 400"]


def test_the_verdict_waits_for_enough_calls_and_fails_a_candidate_shown_worse():
    good, bad = Arm(_call("get_weather", {"unit": "celsius"})), Arm(_call("get_weather", {"unit": "Celsius"}))
    numbers = ShadowNumbers(wanted=10)
    numbers.results = [mirrored(good, good, TOOLS) for _ in range(9)]
    passed, reasons = verdict(numbers)
    assert not passed and reasons == ["shadow: 9 of 10 live calls mirrored before the wait ended"]
    numbers.results.append(mirrored(good, good, TOOLS))
    assert verdict(numbers) == (True, [])  # the same answers: not shown worse
    assert numbers.as_numbers()["agree"] == 1.0
    numbers.results = [mirrored(good, bad, TOOLS) for _ in range(6)] + [mirrored(good, good, TOOLS) for _ in range(4)]
    passed, reasons = verdict(numbers)
    assert not passed and "0.400 with the candidate against 1.000 as served" in reasons[0]
    n = numbers.as_numbers()
    assert n["overall"]["ci_high"] < 0 and n["agree"] == 0.4 and n["serving_problems"] == {}
    numbers.results = [mirrored(bad, good, TOOLS) for _ in range(10)]  # the candidate fixes the calls
    assert verdict(numbers) == (True, [])
    assert "overall" not in numbers.as_numbers(interval=False)


async def _nothing(*_: object) -> bool:
    return True


def _run(candidate: LayerVersion, share: float = 1.0) -> ShadowRun:
    return ShadowRun(candidate, share, wanted=2, concurrency=1, mirror=_nothing)


def test_a_run_takes_calls_of_its_scope_that_the_serving_version_served():
    mine = _run(LayerVersion("c1", "h2", "harness", "acme"))
    assert mine.takes("acme", Applied()) and not mine.takes("other", Applied())
    canary = CanaryRef("v9", "h9", None, "none", 0.5, (), (), datetime.now(UTC))
    in_canary = LayerVersion("v9", "h9", "harness", "acme", canary=canary)
    assert not mine.takes("acme", Applied(harness=in_canary))  # a canary's arm is not what serves
    everyone = _run(LayerVersion("c2", "h3", "harness", None))
    own = LayerVersion("v1", "h1", "harness", "acme")
    glob = LayerVersion("v0", "h0", "harness", None)
    assert everyone.takes("acme", Applied()) and everyone.takes("acme", Applied(harness=glob))
    assert not everyone.takes("acme", Applied(harness=own))  # the tenant's own harness hides a global one
    memory = _run(LayerVersion("c3", "m2", "memory", "acme"))
    assert memory.takes("acme", Applied(harness=own)) and not memory.takes("other", Applied())
    assert not _run(LayerVersion("c4", "h4", "harness", "acme"), share=1e-12).takes("acme", Applied())
    full = _run(LayerVersion("c5", "h5", "harness", "acme"))
    full.taken = 2
    assert not full.takes("acme", Applied())  # it has what it wants
    busy = _run(LayerVersion("c6", "h6", "harness", "acme"))
    busy.in_flight = 1
    assert not busy.takes("acme", Applied())  # no room in flight
