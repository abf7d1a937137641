"""Hypothesis strategies for the fuzz suite's generation bodies (tests/server/test_fuzz.py).

Each strategy draws a request body together with whether the API accepts it: every field
is drawn either from what the API takes (its ranges, types and shapes) or from what it
must refuse (out of range, a wrong type, an unsupported shape). A body drawn only from the
first is `valid`: the server must answer it with a 200; a body with one refused field
must get a 4xx. Generation is kept small (max_tokens 1 to 3, n 1 or 2), so that the real
model answers each body in well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from support.live_server import MODEL

VOCAB_SIZE = 49152  # SmolLM2's vocabulary: token ids in [0, VOCAB_SIZE) are valid
JSON_INT_MAX = 2**63 - 1024  # the largest int any field takes (tokenfleet.server.bounds)


@dataclass(frozen=True)
class Drawn:
    """A generated body, and whether every field of it is one the API accepts."""

    body: dict[str, Any]
    valid: bool


@dataclass(frozen=True)
class Field:
    """One field's values: those the API accepts (`ok`) and those it refuses (`bad`)."""

    ok: st.SearchStrategy[Any]
    bad: st.SearchStrategy[Any] | None = None

    def draw(self, draw: st.DrawFn, only_ok: bool) -> tuple[Any, bool]:
        if only_ok or self.bad is None:
            return draw(self.ok), True
        return draw(st.one_of(self.ok.map(lambda v: (v, True)), self.bad.map(lambda v: (v, False))))


def field(ok: st.SearchStrategy[Any], bad: st.SearchStrategy[Any] | None = None) -> Field:
    return Field(ok, bad)


@dataclass(frozen=True)
class Fragment:
    """Several fields drawn together, where whether one is accepted depends on another
    (stream_options go with stream only): they replace any drawn before them."""

    fields: dict[str, Any]


@st.composite
def body(
    draw: st.DrawFn, required: dict[str, Field], optional: dict[str, Field], only_ok: bool
) -> Drawn:
    """A body of the `required` fields and some of the `optional` ones; with `only_ok`
    every field from its accepted values."""
    values: dict[str, Any] = {}
    accepted: dict[str, bool] = {}
    names = list(required) + draw(st.lists(st.sampled_from(sorted(optional)), unique=True))
    for name in names:
        value, ok = (required.get(name) or optional[name]).draw(draw, only_ok)
        fields = value.fields if isinstance(value, Fragment) else {name: value}
        for key, item in fields.items():
            values[key], accepted[key] = item, ok
    return Drawn(values, all(accepted.values()))


def bodies(required: dict[str, Field], optional: dict[str, Field]) -> st.SearchStrategy[Drawn]:
    """Bodies with every field accepted, and bodies whose fields may be refused, about
    half and half."""
    return st.booleans().flatmap(lambda only_ok: body(required, optional, only_ok))


# -- values shared by the routes ------------------------------------------------------------

# Text of any Unicode character but lone surrogates (no UTF-8 encodes them).
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=24)
WORDS = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=24)
NOT_A_NUMBER = st.one_of(
    st.text(st.sampled_from("abc xyz"), max_size=4),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.just("a"), st.integers(), max_size=1),
)
BIG_INTS = st.sampled_from([2**63, 2**64, 10**30])
TOKEN_ID = st.integers(0, VOCAB_SIZE - 1)
BAD_TOKEN_ID = st.one_of(st.integers(VOCAB_SIZE, 10**7), st.integers(max_value=-1), BIG_INTS)

MODEL_FIELD = field(
    st.just(MODEL),
    st.one_of(
        TEXT.filter(lambda s: s != MODEL), st.integers(), st.none(), st.lists(TEXT, max_size=1)
    ),
)
# An unknown field (each API's model allows them) that makes the body larger than the
# gateway's offload_body_bytes (16 KiB): such a body is checked and tokenized in a thread
# pool before its route runs, another path to the same answers.
PADDING = field(st.integers(17_000, 40_000).map(lambda n: "p" * n))
# Over the context (the prompt plus max_tokens past it) or out of range, or no count.
BAD_MAX_TOKENS = st.one_of(st.sampled_from([0, -1, 10**6, 2**64]), NOT_A_NUMBER)


def floats(low: float, high: float, *, exclude_low: bool = False) -> st.SearchStrategy[float]:
    return st.floats(low, high, exclude_min=exclude_low, allow_nan=False)


def beyond(low: float, high: float) -> st.SearchStrategy[Any]:
    """Numbers outside [low, high], and values that are no number at all."""
    return st.one_of(
        st.floats(max_value=low, exclude_max=True, allow_nan=False, allow_infinity=False),
        st.floats(min_value=high, exclude_min=True, allow_nan=False, allow_infinity=False),
        NOT_A_NUMBER,
    )


# -- OpenAI: /v1/chat/completions and /v1/completions ------------------------------------

OPENAI_SAMPLING: dict[str, Field] = {
    "temperature": field(st.one_of(floats(0, 2), st.none(), st.integers(0, 2)), beyond(0, 2)),
    "top_p": field(
        st.one_of(floats(0, 1, exclude_low=True), st.none()),
        st.one_of(beyond(0, 1), st.just(0)),
    ),
    "top_k": field(
        st.one_of(st.integers(-1, 200), st.integers(-1, JSON_INT_MAX), st.none()),
        st.one_of(st.integers(max_value=-2), BIG_INTS, NOT_A_NUMBER),
    ),
    "n": field(st.one_of(st.integers(1, 2), st.none()), st.sampled_from([0, -1, 17, 2**64])),
    # choice i runs with seed + i: with n at most 2, seed + 1 must still fit
    "seed": field(
        st.one_of(st.integers(-(2**63), JSON_INT_MAX - 1), st.none()),
        st.one_of(st.integers(JSON_INT_MAX + 1, 2**66), st.integers(max_value=-(2**63) - 1)),
    ),
    "stop": field(
        st.one_of(st.none(), TEXT, st.lists(TEXT, max_size=4)),
        st.one_of(
            st.lists(TEXT, min_size=5, max_size=6),
            st.just("s" * 1025),
            st.integers(),
            st.lists(st.integers(), min_size=1, max_size=2),
        ),
    ),
    "presence_penalty": field(st.one_of(floats(-2, 2), st.none()), beyond(-2, 2)),
    "frequency_penalty": field(st.one_of(floats(-2, 2), st.none()), beyond(-2, 2)),
    "logit_bias": field(
        st.one_of(
            st.none(),
            st.dictionaries(TOKEN_ID.map(str), floats(-100, 100), max_size=4),
        ),
        st.one_of(
            st.dictionaries(
                st.sampled_from(["a", "-1", "1.5", ""]), floats(-1, 1), min_size=1, max_size=1
            ),
            st.dictionaries(BAD_TOKEN_ID.map(str), floats(-1, 1), min_size=1, max_size=1),
            st.dictionaries(TOKEN_ID.map(str), beyond(-100, 100), min_size=1, max_size=1),
        ),
    ),
    "stop_token_ids": field(
        st.one_of(st.none(), st.lists(TOKEN_ID, max_size=3)),
        st.lists(BAD_TOKEN_ID, min_size=1, max_size=2),
    ),
    "ignore_eos": field(st.one_of(st.booleans(), st.none())),
    "user": field(st.one_of(TEXT, st.none())),
    # stream_options go with stream only; without it they are refused
    "stream": field(
        st.one_of(
            st.booleans().map(lambda s: Fragment({"stream": s})),
            st.booleans().map(
                lambda u: Fragment({"stream": True, "stream_options": {"include_usage": u}})
            ),
        ),
        st.one_of(
            st.booleans().map(
                lambda u: Fragment({"stream": False, "stream_options": {"include_usage": u}})
            ),
            st.just(Fragment({"stream": "yes please"})),
        ),
    ),
}

CHAT_CONTENT = st.one_of(
    WORDS,
    st.lists(st.builds(lambda t: {"type": "text", "text": t}, WORDS), min_size=1, max_size=3),
)
CHAT_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": CHAT_CONTENT}
)
BAD_CHAT_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["tool", "robot", ""]), "content": WORDS}),
    st.fixed_dictionaries(
        {
            "role": st.just("user"),
            "content": st.one_of(
                st.integers(),
                st.just([{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]),
            ),
        }
    ),
    st.just({"content": "no role"}),
)
CHAT_MESSAGES = field(
    st.lists(CHAT_MESSAGE, min_size=1, max_size=3),
    st.one_of(
        st.just([]),
        st.lists(BAD_CHAT_MESSAGE, min_size=1, max_size=2),
        st.lists(CHAT_MESSAGE, min_size=1, max_size=2).map(lambda ms: [*ms, "not a message"]),
        WORDS,
    ),
)

CHAT_BODIES = bodies(
    {
        "model": MODEL_FIELD,
        "messages": CHAT_MESSAGES,
        # always bounded here: without it the reply would run to the end of the context
        "max_tokens": field(st.integers(1, 3), BAD_MAX_TOKENS),
    },
    {
        **OPENAI_SAMPLING,
        "max_completion_tokens": field(st.integers(1, 3), BAD_MAX_TOKENS),
        "logprobs": field(st.one_of(st.booleans(), st.none())),
        "top_logprobs": field(st.one_of(st.integers(0, 20), st.none()), st.sampled_from([21, -1])),
        "tools": field(
            st.one_of(st.just([]), st.none()),
            st.just([{"type": "function", "function": {"name": "not a name"}}]),
        ),
        "x_padding": PADDING,
    },
)

PROMPT = field(
    st.one_of(
        WORDS,
        st.lists(WORDS, min_size=1, max_size=3),
        st.lists(TOKEN_ID, min_size=1, max_size=8),
        st.lists(st.lists(TOKEN_ID, min_size=1, max_size=4), min_size=1, max_size=3),
    ),
    st.one_of(
        st.sampled_from(["", [], [[]], [""]]),
        st.lists(BAD_TOKEN_ID, min_size=1, max_size=2),
        st.lists(st.lists(BAD_TOKEN_ID, min_size=1, max_size=2), min_size=1, max_size=2),
        st.integers(),
        st.just([{"text": "a prompt"}]),
    ),
)

COMPLETION_BODIES = bodies(
    {
        "model": MODEL_FIELD,
        "prompt": PROMPT,
        "max_tokens": field(st.integers(1, 3), BAD_MAX_TOKENS),
    },
    {
        **OPENAI_SAMPLING,
        "logprobs": field(st.one_of(st.integers(0, 5), st.none()), st.sampled_from([6, -1, 100])),
        # max_tokens 0 scores the prompt: with echo only
        "echo": field(
            st.one_of(
                st.booleans().map(lambda e: Fragment({"echo": e})),
                st.just(Fragment({"echo": True, "max_tokens": 0})),
            ),
            st.just(Fragment({"echo": False, "max_tokens": 0})),
        ),
        "best_of": field(st.just(1), st.just(3)),
        "suffix": field(st.one_of(st.just(""), st.none()), st.just("after")),
        "x_padding": PADDING,
    },
)


# -- Anthropic: /v1/messages ------------------------------------------------------------

# Content that ends in a non-space character: accepted in every turn, prefill included.
ANTHROPIC_TEXT = WORDS.map(lambda s: s.rstrip() or "x")
ANTHROPIC_BLOCKS = st.lists(
    st.builds(lambda t: {"type": "text", "text": t}, ANTHROPIC_TEXT), min_size=1, max_size=3
)
ANTHROPIC_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant"]),
        "content": st.one_of(ANTHROPIC_TEXT, ANTHROPIC_BLOCKS),
    }
)
BAD_ANTHROPIC_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "tool", ""]), "content": WORDS}),
    st.fixed_dictionaries(
        {
            "role": st.just("user"),
            "content": st.one_of(
                st.just(""),
                st.just([{"type": "text", "text": ""}]),
                st.just([{"type": "image", "source": {"type": "url", "url": "http://127.0.0.1"}}]),
                st.integers(),
            ),
        }
    ),
)
ANTHROPIC_MESSAGES = field(
    st.lists(ANTHROPIC_MESSAGE, min_size=1, max_size=3),
    st.one_of(
        st.just([]),
        st.lists(BAD_ANTHROPIC_MESSAGE, min_size=1, max_size=2),
        # a final assistant turn (a prefill) may not end in whitespace
        st.lists(ANTHROPIC_MESSAGE, max_size=2).map(
            lambda ms: [*ms, {"role": "assistant", "content": "ends in a space "}]
        ),
    ),
)

# Strict types: a number in a string, a float for an int, true for 1 are all refused.
MESSAGE_BODIES = bodies(
    {
        "model": MODEL_FIELD,
        "messages": ANTHROPIC_MESSAGES,
        "max_tokens": field(
            st.integers(1, 3), st.one_of(BAD_MAX_TOKENS, st.sampled_from(["2", 2.0, True]))
        ),
    },
    {
        "system": field(
            st.one_of(st.none(), WORDS, ANTHROPIC_BLOCKS),
            st.one_of(
                st.integers(), st.just([{"type": "text", "text": ""}]), st.just([{"type": "image"}])
            ),
        ),
        "temperature": field(
            st.one_of(floats(0, 1), st.integers(0, 1), st.none()),
            st.one_of(beyond(0, 1), st.just("0.5")),
        ),
        "top_p": field(
            st.one_of(floats(0, 1, exclude_low=True), st.none()),
            st.one_of(beyond(0, 1), st.just(0)),
        ),
        "top_k": field(
            st.one_of(st.integers(0, 200), st.integers(0, JSON_INT_MAX), st.none()),
            st.one_of(st.integers(max_value=-1), BIG_INTS, st.just("5")),
        ),
        "stop_sequences": field(
            st.one_of(st.none(), st.lists(WORDS, max_size=16)),
            st.one_of(st.lists(WORDS, min_size=17, max_size=18), st.just(["s" * 1025]), WORDS),
        ),
        "stream": field(st.one_of(st.booleans(), st.none()), st.sampled_from(["true", 1])),
        "metadata": field(
            st.one_of(st.none(), st.fixed_dictionaries({"user_id": st.one_of(TEXT, st.none())})),
            st.one_of(
                st.just({"user_id": "u" * 257}),
                st.just({"user_id": "u", "tier": "gold"}),
                st.just({"user_id": 5}),
            ),
        ),
        "thinking": field(
            st.one_of(st.none(), st.just({"type": "disabled"})),
            st.just({"type": "enabled", "budget_tokens": 1024}),
        ),
        "x_padding": PADDING,
    },
)
