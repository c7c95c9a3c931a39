"""Stop strings: the matcher on its own (unit and property tests) and through Engine.stream_steps."""

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_infer.generation.stops import StopStringMatcher


def run(stops, chunks):
    """Feed cumulative text chunk by chunk; returns (released pieces, stopped)."""
    m = StopStringMatcher(stops)
    text, pieces = "", []
    for chunk in chunks:
        text += chunk
        out, hit = m.feed(text)
        pieces.append(out)
        if hit:
            return pieces, True
    pieces.append(m.flush(text))
    return pieces, False


def test_no_stops_releases_everything():
    assert run([], ["ab", "cd"]) == (["ab", "cd", ""], False)


def test_stop_inside_one_chunk():
    pieces, hit = run(["STOP"], ["hello STOP world"])
    assert hit and "".join(pieces) == "hello "


def test_stop_spanning_several_feeds_is_held_back():
    pieces, hit = run(["<|end|>"], ["Hi <", "|en", "d", "|> more"])
    assert hit
    assert pieces == ["Hi ", "", "", ""]  # nothing of "<|end|>" was ever released


def test_held_back_prefix_released_when_it_turns_out_not_to_be_a_stop():
    pieces, hit = run(["<|end|>"], ["Hi <", "|en", "ter"])
    assert not hit
    assert pieces == ["Hi ", "", "<|enter", ""]


def test_partial_stop_at_the_end_is_flushed():
    pieces, hit = run(["###"], ["a#", "#"])
    assert not hit and "".join(pieces) == "a##"
    assert pieces[:2] == ["a", ""]


def test_overlapping_prefixes():
    # "aab": after "aa" the suffix "a" (not "aa") may still start the stop
    pieces, hit = run(["aab"], ["a", "a", "a", "b"])
    assert hit and "".join(pieces) == "a"
    pieces, hit = run(["abab"], ["ab", "ab"])
    assert hit and "".join(pieces) == ""
    pieces, hit = run(["abac"], ["ab", "ab", "ac"])
    assert hit and "".join(pieces) == "ab"


def test_multiple_stops_first_occurrence_wins():
    pieces, hit = run(["world", "lo"], ["hello world"])
    assert hit and "".join(pieces) == "hel"
    pieces, hit = run(["xyz", "\n\n"], ["line one\n", "\nline two xyz"])
    assert hit and "".join(pieces) == "line one"


def test_stop_at_very_start():
    pieces, hit = run(["User:"], ["Us", "er:", " hi"])
    assert hit and "".join(pieces) == ""


def expected(stops, chunks):
    text = ""
    for chunk in chunks:
        text += chunk
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), min_size=1, max_size=3),
    chunks=st.lists(st.text(alphabet="ab cd", max_size=5), max_size=12),
)
def test_property_released_text(stops, chunks):
    pieces, hit = run(stops, chunks)
    released = "".join(pieces)
    want, want_hit = expected(stops, chunks)
    assert (released, hit) == (want, want_hit)
    # the released text never contains a stop string, and grows only by appending
    assert not any(s in released for s in stops)


# --------------------------------------------------------------------------------------------
# Through the engine, with a fake token source


def stream_text(engine, fake_tokens, text, **kw):
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    fake_tokens(ids)
    steps = list(engine.stream_steps("prompt", chat_template=False, max_tokens=len(ids) + 5, **kw))
    return ids, steps


def test_engine_stop_string_spanning_tokens(tiny_engine, fake_tokens):
    text = "the capital of france is paris. stop here and there."
    ids, steps = stream_text(tiny_engine, fake_tokens, text, stop=["is paris"])
    # the stop string really spans tokens in this vocabulary
    assert len(tiny_engine.tokenizer.encode("is paris", add_special_tokens=False)) > 1
    released = ""
    for step in steps:
        released += step.text
        assert "is" not in released[len("the capital of france "):]  # never emitted, not even in part
    assert released == "the capital of france "
    assert steps[-1].finish_reason == "stop"
    assert len(steps) < len(ids)  # decoding stopped early


def test_engine_multiple_stops_and_no_hit(tiny_engine, fake_tokens):
    text = "hello world, hello there."
    _, steps = stream_text(tiny_engine, fake_tokens, text, stop=["there", "world"])
    assert "".join(s.text for s in steps) == "hello " and steps[-1].finish_reason == "stop"
    _, steps = stream_text(tiny_engine, fake_tokens, text, stop=["nowhere", "re."])
    assert "".join(s.text for s in steps) == "hello world, hello the" and steps[-1].finish_reason == "stop"
    ids, steps = stream_text(tiny_engine, fake_tokens, text, stop=["the end"])
    assert "".join(s.text for s in steps) == text
    assert steps[-1].finish_reason == "length" or steps[-1].finish_reason is not None


def test_engine_eos_ends_generation(tiny_engine, fake_tokens):
    eos = tiny_engine.tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert len(eos) == 1 and eos[0] in tiny_engine.tokenizer.eos_token_ids
    ids = tiny_engine.tokenizer.encode("hello there", add_special_tokens=False)
    fake_tokens(ids + eos + ids)
    result = tiny_engine.generate("prompt", chat_template=False, max_tokens=50)
    assert result.token_ids == ids and result.text == "hello there" and result.finish_reason == "stop"
    assert result.stats.generated_tokens == len(ids)


def test_engine_max_tokens(tiny_engine, fake_tokens):
    ids = tiny_engine.tokenizer.encode("hello world, hello there.", add_special_tokens=False)
    fake_tokens(ids)
    result = tiny_engine.generate("prompt", chat_template=False, max_tokens=3)
    assert result.token_ids == ids[:3] and result.finish_reason == "length"
    assert result.text == tiny_engine.tokenizer.decode(ids[:3])
