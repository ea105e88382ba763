"""The stream interval: a choice's first text and its end go out at once, between them text
waits for `tokens` tokens or `ms` since the choice's last message."""

from carpool.generation.coalesce import StreamCoalescer
from carpool.generation.sequence import SeqEvent


def token(index: int, n: int, finish: str | None = None) -> SeqEvent:
    return SeqEvent(index=index, text=f"t{n} ", token_ids=[n], finish_reason=finish)


def texts(events: list[SeqEvent]) -> list[tuple[int, str]]:
    return [(e.index, e.text) for e in events]


def test_first_token_alone_then_messages_of_the_interval_then_the_end_at_once():
    now = [0.0]
    held = StreamCoalescer(tokens=3, ms=10_000, clock=lambda: now[0])
    assert texts(held.add([token(0, 1)])) == [(0, "t1 ")]
    assert held.add([token(0, 2)]) == []
    assert held.add([token(0, 3)]) == []
    merged = held.add([token(0, 4)])
    assert texts(merged) == [(0, "t2 t3 t4 ")]
    assert merged[0].token_ids == [2, 3, 4]
    assert held.add([token(0, 5)]) == []
    end = held.add([token(0, 6, finish="length")])
    assert texts(end) == [(0, "t5 t6 ")] and end[0].finish_reason == "length"


def test_held_text_goes_out_once_the_interval_ms_have_passed():
    now = [0.0]
    held = StreamCoalescer(tokens=100, ms=50, clock=lambda: now[0])
    held.add([token(0, 1)])
    now[0] = 0.049
    assert held.add([token(0, 2)]) == []
    now[0] = 0.05
    assert texts(held.add([token(0, 3)])) == [(0, "t2 t3 ")]


def test_choices_are_held_apart():
    now = [0.0]
    held = StreamCoalescer(tokens=2, ms=10_000, clock=lambda: now[0])
    assert texts(held.add([token(0, 1), token(1, 1)])) == [(0, "t1 "), (1, "t1 ")]
    assert held.add([token(0, 2)]) == []
    # Choice 1's second token does not release choice 0's single held one.
    assert held.add([token(1, 2)]) == []
    assert texts(held.add([token(0, 3), token(1, 3)])) == [(0, "t2 t3 "), (1, "t2 t3 ")]


def test_an_interval_of_one_token_sends_every_batch_as_it_comes():
    held = StreamCoalescer(tokens=1, ms=0, clock=lambda: 0.0)
    assert [texts(held.add([token(0, n)])) for n in range(1, 4)] == [
        [(0, "t1 ")],
        [(0, "t2 ")],
        [(0, "t3 ")],
    ]
