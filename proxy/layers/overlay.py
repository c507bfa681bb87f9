"""A harness overlay: what the proxy changes in every call of its scope before the call goes out.

Pure. The doors translate every API into a chat-completions body before it is sent (to vLLM or, through
LiteLLM, to a provider), so one overlay of that body covers all three doors and the provider routes:

- `system_append`: text added to the system prompt (after the client's own system message, or as one);
- `tools`: per tool name, a new `description` or a `description_append`, a whole new `parameters`
  schema, or `properties`: per argument, keys merged into that argument's schema (a clearer
  `description`, an `enum`, a `pattern`);
- `stop`: stop sequences added to the client's.

`parse_overlay` checks an operator's or a proposal's spec (the 400 names the field); `apply_harness`
returns a new body and never changes the one it was given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.evolve.signals import JsonValue

MAX_TEXT = 8000  # a system addition or a description
MAX_STOPS = 4  # OpenAI's own limit on stop sequences


class OverlayError(ValueError):
    """The spec is not an overlay; the message names the field."""


@dataclass(frozen=True)
class ToolPatch:
    description: str | None = None
    description_append: str | None = None
    parameters: dict[str, JsonValue] | None = None
    properties: dict[str, dict[str, JsonValue]] = field(default_factory=dict)


@dataclass(frozen=True)
class HarnessOverlay:
    system_append: str | None = None
    tools: dict[str, ToolPatch] = field(default_factory=dict)
    stop: tuple[str, ...] = ()

    def is_empty(self) -> bool:
        return not (self.system_append or self.tools or self.stop)

    def to_spec(self) -> dict[str, JsonValue]:
        tools: dict[str, JsonValue] = {}
        for name, p in self.tools.items():
            patch: dict[str, JsonValue] = {}
            if p.description is not None:
                patch["description"] = p.description
            if p.description_append is not None:
                patch["description_append"] = p.description_append
            if p.parameters is not None:
                patch["parameters"] = p.parameters
            if p.properties:
                patch["properties"] = dict(p.properties)
            tools[name] = patch
        spec: dict[str, JsonValue] = {}
        if self.system_append:
            spec["system_append"] = self.system_append
        if tools:
            spec["tools"] = tools
        if self.stop:
            spec["stop"] = list(self.stop)
        return spec


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise OverlayError(f"{where}: a non-empty string")
    if len(value) > MAX_TEXT:
        raise OverlayError(f"{where}: at most {MAX_TEXT} characters")
    return value


def parse_overlay(spec: object) -> HarnessOverlay:
    """The overlay a spec describes; raises OverlayError naming the first field that is wrong."""
    if not isinstance(spec, dict):
        raise OverlayError("overlay: an object")
    unknown = set(spec) - {"system_append", "tools", "stop"}
    if unknown:
        raise OverlayError(f"overlay: unknown field {sorted(unknown)[0]!r} (system_append, tools, stop)")
    system = _text(spec["system_append"], "overlay.system_append") if spec.get("system_append") is not None else None
    tools: dict[str, ToolPatch] = {}
    raw_tools = spec.get("tools") or {}
    if not isinstance(raw_tools, dict):
        raise OverlayError("overlay.tools: an object of tool name -> patch")
    for name, patch in raw_tools.items():
        where = f"overlay.tools.{name}"
        if not isinstance(patch, dict) or not patch:
            raise OverlayError(f"{where}: a non-empty object")
        unknown = set(patch) - {"description", "description_append", "parameters", "properties"}
        if unknown:
            raise OverlayError(f"{where}: unknown field {sorted(unknown)[0]!r}")
        params = patch.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise OverlayError(f"{where}.parameters: a JSON schema of type object")
        props = patch.get("properties") or {}
        if not isinstance(props, dict) or not all(isinstance(v, dict) and v for v in props.values()):
            raise OverlayError(f"{where}.properties: an object of argument name -> schema keys")
        tools[name] = ToolPatch(
            description=_text(patch["description"], f"{where}.description") if "description" in patch else None,
            description_append=(_text(patch["description_append"], f"{where}.description_append")
                                if "description_append" in patch else None),
            parameters=params, properties=props)
    stop = spec.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOPS:
        raise OverlayError(f"overlay.stop: up to {MAX_STOPS} non-empty strings")
    overlay = HarnessOverlay(system_append=system, tools=tools, stop=tuple(stop))
    if overlay.is_empty():
        raise OverlayError("overlay: changes nothing (system_append, tools or stop)")
    return overlay


def apply_harness(body: dict[str, Any], overlay: HarnessOverlay) -> dict[str, Any]:
    """The chat-completions body with the overlay applied (a new dict; `body` is left as it was)."""
    out = dict(body)
    if overlay.system_append:
        out["messages"] = _with_system(list(body.get("messages") or []), overlay.system_append)
    if overlay.tools and isinstance(body.get("tools"), list):
        out["tools"] = [_patched_tool(tool, overlay.tools) for tool in body["tools"]]
    if overlay.stop:
        stop = body.get("stop")
        have = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, list) else []
        out["stop"] = have + [s for s in overlay.stop if s not in have][: max(0, MAX_STOPS - len(have))]
    return out


def _with_system(messages: list[Any], addition: str) -> list[Any]:
    first = messages[0] if messages else None
    if isinstance(first, dict) and first.get("role") in ("system", "developer"):
        content = first.get("content")
        if isinstance(content, str):
            merged: Any = f"{content}\n\n{addition}" if content else addition
        elif isinstance(content, list):
            merged = [*content, {"type": "text", "text": addition}]
        else:
            merged = addition
        return [{**first, "content": merged}, *messages[1:]]
    return [{"role": "system", "content": addition}, *messages]


def _patched_tool(tool: Any, patches: dict[str, ToolPatch]) -> Any:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or fn.get("name") not in patches:
        return tool
    p = patches[fn["name"]]
    new_fn = dict(fn)
    if p.description is not None:
        new_fn["description"] = p.description
    if p.description_append is not None:
        old = fn.get("description") or ""
        new_fn["description"] = f"{old} {p.description_append}".strip()
    if p.parameters is not None:
        new_fn["parameters"] = p.parameters
    if p.properties:
        params = dict(new_fn.get("parameters") or {"type": "object"})
        props = dict(params.get("properties") or {})
        for arg, keys in p.properties.items():
            base = props.get(arg)
            props[arg] = {**(base if isinstance(base, dict) else {}), **keys}
        params["properties"] = props
        new_fn["parameters"] = params
    return {**tool, "function": new_fn}


def merge_overlays(base: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """`new` on top of `base` (both specs): a proposal adds its fixes to the overlay that serves. Per
    tool, the new patch's keys win and their argument patches merge; the system addition and the stop
    sequences are kept and extended."""
    if not base:
        return dict(new)
    out: dict[str, Any] = {}
    systems = [x for x in (base.get("system_append"), new.get("system_append")) if x]
    if systems:
        out["system_append"] = "\n\n".join(dict.fromkeys(systems))
    tools = {name: dict(patch) for name, patch in (base.get("tools") or {}).items()}
    for name, patch in (new.get("tools") or {}).items():
        merged = tools.setdefault(name, {})
        for key, value in patch.items():
            if key == "properties":
                props = dict(merged.get("properties") or {})
                props.update(value)
                merged["properties"] = props
            else:
                merged[key] = value
    if tools:
        out["tools"] = tools
    stops = [*(base.get("stop") or []), *(new.get("stop") or [])]
    if stops:
        out["stop"] = list(dict.fromkeys(stops))[:MAX_STOPS]
    return out
