from pdserve.engine.stop_strings import StopStringMatcher


def stream(matcher: StopStringMatcher, pieces: list[str]) -> str:
    out = []
    for piece in pieces:
        out.append(matcher.feed(piece))
        if matcher.stopped:
            break
    else:
        out.append(matcher.flush())
    return "".join(out)


def test_stop_split_across_deltas_is_never_emitted() -> None:
    m = StopStringMatcher(("STOP",))
    assert m.feed("hello ST") == "hello "
    assert m.feed("O") == ""
    assert m.feed("P and more") == ""
    assert m.stopped


def test_include_stop_keeps_the_stop_string() -> None:
    assert stream(StopStringMatcher(("\n\n",), include_stop=True), ["a\n", "\nb"]) == "a\n\n"


def test_false_partial_match_is_released() -> None:
    m = StopStringMatcher(("STOP",))
    assert m.feed("ST") == ""
    assert m.feed("ART") == "START"
    assert not m.stopped


def test_earliest_of_several_stops_wins() -> None:
    assert stream(StopStringMatcher(("world", "lo")), ["hello world"]) == "hel"


def test_flush_returns_held_back_tail_when_sequence_ends_otherwise() -> None:
    assert stream(StopStringMatcher(("xyz",)), ["abc x"]) == "abc x"
