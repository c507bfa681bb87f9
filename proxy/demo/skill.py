"""The demo's task family: look a code up with a tool, then report it.

Every item (a made-up name such as "tarimo") has a secret 3-digit code in a table the model has
never seen: the only way to answer "What is the code of tarimo?" is to call the tool and copy its
result. The agent's side of the protocol is plain text that the system prompt teaches (SmolLM2's
chat template has no tool-call syntax of its own):

    turn 1   model:  lookup("tarimo")                     (the agent parses the first such call)
             agent:  runs the tool, sends 'lookup("tarimo") returned 583.' as the next user turn
    turn 2   model:  583                                  (solved: the reply's only number is the code)

A task is solved only if turn 1 holds a well-formed call naming the right item and turn 2's reply
contains the code and no other number. No call, a malformed call or an empty reply ends the attempt
unsolved. The reward is 1 for solved, else 0: correctness only, nothing for form or length.

The item names are split once (fixed seed, independent of the demo's --seed) into training items
and two disjoint evaluation splits, `dev` (for tuning the demo's settings) and `heldout` (reported
per version, never trained on, never looked at while tuning).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

SYSTEM = (
    "You answer questions about item codes. You do not know any code: you must look it up with the "
    'tool. To call the tool, reply with only: lookup("ITEM"). The result comes back in the next '
    "message; then reply with only the code."
)
QUESTION = 'What is the code of "{item}"?'
RESULT = 'lookup("{item}") returned {code}. Reply with only the code.'
UNKNOWN = 'lookup("{item}") returned: no such item. Reply with only the code.'
# One worked example before the question: without it SmolLM2-135M never calls the tool (0 of 48
# greedy dev tasks, 1 valid call in 128 sampled attempts: bench/demo_skill_probe.py).
EXAMPLE_ITEM, EXAMPLE_CODE = "tarimo", 583
EXAMPLE = [
    {"role": "user", "content": QUESTION.format(item=EXAMPLE_ITEM)},
    {"role": "assistant", "content": f'lookup("{EXAMPLE_ITEM}")'},
    {"role": "user", "content": RESULT.format(item=EXAMPLE_ITEM, code=EXAMPLE_CODE)},
    {"role": "assistant", "content": str(EXAMPLE_CODE)},
]
CALL = re.compile(r"""lookup\(\s*["']?\s*([A-Za-z]+)\s*["']?\s*\)""")
NUMBER = re.compile(r"\d+")

_SYLLABLES = ["ka", "lo", "mi", "ru", "te", "zo", "ba", "ne", "fi", "do", "sa", "vu", "pe", "ri", "go", "la", "mo", "ti", "xu", "we", "na", "ko", "di"]
SPLIT_SEED = "atdp-demo-skill-v1"  # fixed: the splits never depend on a run's settings
N_HELDOUT = 96
N_DEV = 48


@dataclass(frozen=True)
class Task:
    id: str  # sent as X-ATDP-Task-Id: attempts at one task form one GRPO group
    item: str
    code: int

    @property
    def question(self) -> str:
        return QUESTION.format(item=self.item)

    def messages(self) -> list[dict[str, str]]:
        """The system prompt, one worked example (an item outside the table), then the question."""
        return [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": self.question}]


@dataclass(frozen=True)
class Outcome:
    valid_call: bool  # turn 1 held a well-formed lookup(...) call
    right_item: bool  # ...naming the task's item
    solved: bool  # turn 2 reported the code
    reward: float


def _items() -> list[str]:
    """All item names, in a fixed shuffled order: 2- and 3-syllable made-up words."""
    names = {a + b for a in _SYLLABLES for b in _SYLLABLES if a != b}
    names |= {a + b + c for a in _SYLLABLES[:12] for b in _SYLLABLES[:12] for c in _SYLLABLES[:12] if len({a, b, c}) == 3}
    ordered = sorted(names)
    random.Random(SPLIT_SEED).shuffle(ordered)
    return ordered


ITEMS = _items()
SPLITS = {"heldout": ITEMS[:N_HELDOUT], "dev": ITEMS[N_HELDOUT:N_HELDOUT + N_DEV], "train": ITEMS[N_HELDOUT + N_DEV:]}
# The tool's table: one code per item, the same for every run.
_table_rng = random.Random(SPLIT_SEED + ":codes")
TABLE: dict[str, int] = {item: _table_rng.randint(100, 999) for item in ITEMS}


def lookup(item: str) -> int | None:
    """The tool."""
    return TABLE.get(item.lower())


def split_tasks(split: str, n: int | None = None) -> list[Task]:
    """The first n tasks of an evaluation split (`heldout` or `dev`), always the same."""
    return [Task(id=f"{split}-{item}", item=item, code=TABLE[item]) for item in SPLITS[split][:n]]


def make_tasks(n: int, *, seed: int, round_no: int = 0) -> list[Task]:
    """n distinct training tasks for one round; the same (seed, round) gives the same tasks."""
    items = random.Random(f"{seed}:{round_no}").sample(SPLITS["train"], n)
    return [Task(id=f"demo-r{round_no:02d}-{item}", item=item, code=TABLE[item]) for item in items]


def parse_call(reply: str) -> str | None:
    """The item named by the first lookup(...) call in a reply, or None."""
    m = CALL.search(reply)
    return m.group(1).lower() if m else None


def tool_result(item: str) -> str:
    code = lookup(item)
    return UNKNOWN.format(item=item) if code is None else RESULT.format(item=item, code=code)


def reports_code(reply: str, code: int, *, truncated: bool = False) -> bool:
    """The reply's only number is the code (text around it allowed); a reply cut at max_tokens fails."""
    return not truncated and NUMBER.findall(reply) == [str(code)]


def outcome(task: Task, call_reply: str, answer: str | None, *, truncated: bool = False) -> Outcome:
    """Score one attempt: turn 1's reply and turn 2's (None when turn 1 held no call)."""
    item = parse_call(call_reply)
    right = item == task.item
    solved = right and answer is not None and reports_code(answer, task.code, truncated=truncated)
    return Outcome(valid_call=item is not None, right_item=right, solved=solved, reward=1.0 if solved else 0.0)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval for k successes in n trials (95% by default)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / d
    return (max(0.0, mid - half), min(1.0, mid + half))
