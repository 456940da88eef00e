"""A user's own export, not the sample corpus: support answers in the landing zone, with no eval
sets beside them. Every record is written in its own words (no two are near duplicates)."""

from __future__ import annotations

import random
from pathlib import Path

from pipeline_assets_tests.conftest import write_landing_file

PRODUCTS = ["router", "laptop", "printer", "phone", "tablet", "camera", "speaker", "monitor"]
FAULTS = [
    "will not turn on",
    "keeps restarting",
    "drops the wifi connection",
    "shows a blank screen",
    "makes a buzzing noise",
    "runs very hot",
    "will not charge",
    "loses its settings",
]
STEPS = [
    "Unplug it for thirty seconds and plug it back in.",
    "Hold the reset button until the light blinks twice.",
    "Open the settings menu and choose factory defaults.",
    "Check that the cable is firmly seated at both ends.",
    "Install the latest firmware from the support page.",
    "Try a different power outlet, ideally not on a strip.",
    "Remove the battery, wait a minute, then put it back.",
    "Turn off power saving under the advanced tab.",
    "Move it away from microwaves and cordless phones.",
    "Clear the cache from the storage section.",
    "Run the built-in diagnostic from the help screen.",
    "Sign out of your account and sign back in.",
    "Clean the vents with compressed air.",
]
CLOSERS = [
    "If that does not help, reply with the serial number and we will arrange a repair.",
    "Most customers find this fixes it within a few minutes.",
    "Let us know how it goes and we can escalate if needed.",
    "Your warranty covers a replacement if the fault persists.",
]


def support_answers(n: int, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        product, fault = rng.choice(PRODUCTS), rng.choice(FAULTS)
        steps = " ".join(rng.sample(STEPS, rng.randint(3, 6)))
        rows.append(
            {
                "id": f"ticket-{i}",
                "prompt": f"Hi, my {product} {fault} since order {rng.randint(10000, 99999)} "
                "arrived. What should I do?",
                "response": f"Sorry to hear your {product} {fault}. {steps} {rng.choice(CLOSERS)}",
            }
        )
    return rows


def land_support_export(home: Path, n: int, name: str = "export.jsonl") -> Path:
    """``n`` support answers as ``$PIPELINE_HOME/landing/support/<name>``."""
    return write_landing_file(home / "landing", "support", name, support_answers(n))


def support_preference_pairs(n: int, seed: int = 5) -> list[dict]:
    """The support answers as preference pairs: each answer chosen over a curt non-answer."""
    rng = random.Random(seed)
    return [
        {
            "prompt": row["prompt"],
            "chosen": row["response"],
            "rejected": rng.choice(["idk", "Restart it.", "No idea, sorry."]),
        }
        for row in support_answers(n)
    ]


def support_conversations(n: int, seed: int = 9) -> list[dict]:
    """``n`` support chats of two or three exchanges, in the messages shape: a fault, a first fix,
    a follow-up and another fix (each chat in its own words, like the support answers)."""
    rng = random.Random(seed)
    chats = []
    for i in range(n):
        product, fault = rng.choice(PRODUCTS), rng.choice(FAULTS)
        steps = rng.sample(STEPS, 6)
        turns = [
            {
                "role": "user",
                "content": f"My {product} {fault} (case {rng.randint(10000, 99999)}).",
            },
            {"role": "assistant", "content": f"Sorry about that. {' '.join(steps[:2])}"},
        ]
        for follow_up in range(rng.randint(1, 2)):
            turns += [
                {"role": "user", "content": f"Tried that, it still {fault}. Anything else?"},
                {
                    "role": "assistant",
                    "content": f"{' '.join(steps[2 + 2 * follow_up : 4 + 2 * follow_up])} "
                    f"{rng.choice(CLOSERS)}",
                },
            ]
        chats.append({"id": f"chat-{i}", "messages": turns})
    return chats


def land_support_chats(home: Path, n: int, name: str = "chats.jsonl") -> Path:
    """``n`` support chats as ``$PIPELINE_HOME/landing/chats/<name>``, a conversation source."""
    return write_landing_file(home / "landing", "chats", name, support_conversations(n))
