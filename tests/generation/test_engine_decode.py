"""Engine.decode: the text of token ids, the inverse of encode for a plain prompt; what generate's text is
for its token ids; bad ids are one MlxInferError line."""

import numpy as np
import pytest

from mlx_infer.errors import MlxInferError


def test_decode_inverts_encode_and_matches_generate(default_engine):
    text = "The capital of France is Paris."
    assert default_engine.decode(default_engine.encode(text, chat_template=False)) == text
    result = default_engine.generate("Name three colors.", max_tokens=8)
    assert result.finish_reason == "length"
    assert default_engine.decode(result.token_ids) == result.text
    assert default_engine.decode(np.array(result.token_ids)) == result.text  # any iterable of integers


@pytest.mark.parametrize("ids, needle", [([1, 10 ** 9], "token id 1000000000 is outside"), ([-3], "token id -3"),
                                         ([True], "token ids must be ints, got True"),
                                         (["7"], "token ids must be ints, got '7' \\(str\\)"),
                                         (None, "decode takes a list of token ids"), ("12", "got str")])
def test_decode_refuses_ids_outside_the_vocabulary(default_engine, ids, needle):
    with pytest.raises(MlxInferError, match=needle):
        default_engine.decode(ids)


@pytest.mark.parametrize("prompt,needle", [
    (42, "got int"), (None, "got NoneType"), (b"Hi", "got bytes"),
    ({"role": "user", "content": "Hi"}, "wrap the message in a list"),
    ([[1.5, 2.0]], "token ids \\(ints\\) or chat messages"), ([1, "a"], "not a mix"),
    ([{"role": "user"}], "each chat message must be a dict"), ([], "the prompt is empty"),
])
def test_encode_refuses_what_is_no_prompt(default_engine, prompt, needle):
    """A prompt of another kind than a string, messages or token ids is one MlxInferError that says what
    was wrong, never a TypeError or bytes read as token ids; the same through generate."""
    with pytest.raises(MlxInferError, match=needle):
        default_engine.encode(prompt)
    with pytest.raises(MlxInferError, match=needle):
        default_engine.generate(prompt, max_tokens=1)


@pytest.mark.parametrize("system", [5, ["be brief"]])
def test_a_system_prompt_that_is_no_string_is_an_mlx_infer_error(default_engine, system):
    with pytest.raises(MlxInferError, match="the system prompt must be a string, got "):
        default_engine.generate("hi", system=system, max_tokens=1)



def test_encode_takes_token_ids_from_any_iterable(default_engine):
    """Token ids need not be a list: a tuple, a range or a generator of ints gives the same ids."""
    ids = default_engine.encode("Hello there")
    for form in (tuple(ids), range(ids[0], ids[0] + 1), (t for t in ids)):
        want = list(range(ids[0], ids[0] + 1)) if isinstance(form, range) else ids
        assert default_engine.encode(form) == want
