"""The engine's streaming detokenizer: its text is `tokenizer.decode(ids)` exactly, and while it
streams it is always a prefix of that, never ending in a broken UTF-8 sequence.

The tokenizers are the ones the engine gets: built from a GGUF's metadata, saved, and loaded back by
mlx-lm (the default SmolLM2 GGUF: byte-level BPE; the Gemma-3 GGUF: SentencePiece with byte
fallback; the tiny GGUF vocabularies of gguf_factory: both kinds, and a SentencePiece one whose
decoder strips the prefix space).
"""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import load as load_tokenizer

from gguf_factory import TinySpec, random_weights, spm_tokenizer, tiny_gguf, write_gguf
from mlx_infer.generation.detokenize import ByteLevelDetokenizer, SentencePieceDetokenizer, make_detokenizer
from mlx_infer.loading.gguf import open_gguf, read_fields
from mlx_infer.loading.gguf_tokenizer import build_tokenizer

KINDS = {
    "smollm2": ByteLevelDetokenizer,
    "gemma3": SentencePieceDetokenizer,
    "tiny-bpe": ByteLevelDetokenizer,
    "tiny-spm": SentencePieceDetokenizer,
    "tiny-spm-strip": SentencePieceDetokenizer,
}
#: Text a model may write: spaces first and last, punctuation, digits, accents, CJK, emoji (ZWJ too).
REAL_TEXT = [
    " Paris.",
    " The capital of France is Paris.\n\nIt is known for the Eiffel Tower ",
    "  two spaces, then\ttabs\tand\nnewlines\n",
    "Hello 👋 world! 日本語のテキスト, 中文, 한국어 and emoji 🙂🎉👨‍👩‍👧 ✓ — done.",
    " café naïve façade Ωmega ½ 3.14159 e=mc² «quotes» 'single' \"double\"",
]


def gguf_tokenizer(gguf: Path, out: Path):
    """The tokenizer the engine loads for a GGUF file: built from its metadata, saved, loaded by mlx-lm."""
    build_tokenizer(read_fields(open_gguf(gguf))).save_pretrained(str(out))
    return load_tokenizer(out)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> a factory of that tokenizer (each built on first use: the real ones need their GGUF)."""
    built = {}
    root = tmp_path_factory.mktemp("tokenizers")

    def tiny(name, arch, tokenizer=None):
        if tokenizer is None:
            return tiny_gguf(root / f"{name}.gguf", arch)[0]
        spec = TinySpec(arch, tokenizer=tokenizer)
        return write_gguf(root / f"{name}.gguf", spec, random_weights(spec))

    def strip_spm():
        tok = spm_tokenizer()
        tok.extra = {"tokenizer.ggml.add_space_prefix": True}
        return tok

    def get(name, request):
        if name not in built:
            if name == "smollm2":
                path = request.getfixturevalue("default_gguf")
            elif name == "gemma3":
                path = request.getfixturevalue("gemma_gguf")
            elif name == "tiny-bpe":
                path = tiny(name, "llama")
            elif name == "tiny-spm":
                path = tiny(name, "gemma3", spm_tokenizer())
            else:
                path = tiny(name, "llama", strip_spm())
            out = root / name
            out.mkdir()
            built[name] = gguf_tokenizer(path, out)
        return built[name]

    return get


@pytest.fixture(scope="module")
def detokenizers():
    """One detokenizer and pool of interesting ids per tokenizer (both read the whole vocabulary)."""
    return {}


@pytest.fixture(params=list(KINDS))
def tok(request, tokenizers):
    return tokenizers(request.param, request)


@pytest.fixture
def detok(request, tok, detokenizers):
    name = request.node.callspec.params["tok"]
    if name not in detokenizers:
        detokenizers[name] = (make_detokenizer(tok), interesting_ids(tok))
    return detokenizers[name][0]


@pytest.fixture
def pool(request, detok, detokenizers):
    return detokenizers[request.node.callspec.params["tok"]][1]


def stream(detok, ids):
    """Feed `ids` one by one; return the texts seen after each token and the final text."""
    detok.reset()
    seen = []
    for i in ids:
        detok.add_token(i)
        seen.append(detok.text)
    detok.finalize()
    return seen, detok.text


def check(tok, detok, ids):
    want = tok.decode(ids)
    seen, final = stream(detok, ids)
    assert final == want, (ids, tok.convert_ids_to_tokens(ids))
    assert detok.tokens == list(ids)
    previous = ""
    for text in seen:  # a growing prefix of the final text
        assert text.startswith(previous) and want.startswith(text), (ids, seen)
        previous = text
    if "\ufffd" not in want:  # never an unfinished character shown as a replacement
        assert all("\ufffd" not in text for text in seen)
    return seen


def interesting_ids(tok) -> list:
    """Ids a uniform draw over a large vocabulary rarely hits: byte tokens, specials, space tokens."""
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    picked = [i for i, t in enumerate(tokens) if t is not None and (
        (len(t) == 6 and t.startswith("<0x")) or len(t) == 1 or t.strip("\u2581 Ġ") == "")]
    return picked + list(tok.all_special_ids)


def test_kind(request, tokenizers):
    for name, kind in KINDS.items():
        try:
            tok = tokenizers(name, request)
        except pytest.skip.Exception:
            continue
        assert type(make_detokenizer(tok)) is kind, name


@pytest.mark.parametrize("text", REAL_TEXT)
def test_real_text(tok, detok, text):
    ids = tok.encode(text, add_special_tokens=False)
    check(tok, detok, ids)


def test_first_token_keeps_its_leading_space(request, tok, detok):
    """`generate "The capital of France is" --no-chat-template` printed 'Paris.' for ' Paris.'."""
    ids = tok.encode(" Paris.", add_special_tokens=False)
    want = tok.decode(ids)
    _, final = stream(detok, ids)
    assert final == want
    if request.node.callspec.params["tok"] != "tiny-spm-strip":  # its decoder strips one leading space
        assert want.startswith(" ")


def test_reset_starts_over(tok, detok):
    a = tok.encode(" first answer 🙂", add_special_tokens=False)
    b = tok.encode(" second", add_special_tokens=False)
    stream(detok, a[:-1])  # left unfinished
    _, final = stream(detok, b)
    assert final == tok.decode(b)


def test_byte_tokens_the_library_decodes_its_own_way(request, tok, detok):
    """SentencePiece byte runs that are not UTF-8 (one U+FFFD per byte token, valid bytes included),
    a '▁' spelled in bytes (not a space); byte-level BPE's byte 0."""
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    index = {t: i for i, t in enumerate(tokens)}
    if KINDS[request.node.callspec.params["tok"]] is SentencePieceDetokenizer:
        cases = [["<0x41>", "<0xFF>"], ["<0xE2>", "<0x96>", "<0x81>"], ["<0xE2>", "<0x82>"],
                 ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"], ["<0xE2>", "<0x82>", "<0x41>", "<0xAC>"]]
        words = [t for t in tokens if t.startswith("\u2581") and len(t) > 2][:2]
        cases += [["<0xE2>", words[0], "<0x82>", "<0xAC>", words[1]], [words[0], "<0xC3>"]]
    else:  # "Ā" stands for byte 0, "Ġ" for a space
        cases = [["Ā"], ["Ġ", "Ā", "Ġ"], ["Ġ"], ["Ġ", "Ġ"], ["Ã", "Ġ", "©"]]
    for case in cases:
        check(tok, detok, [index[t] for t in case])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_token_sequences(tok, detok, pool, data):
    ids = data.draw(st.lists(st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(pool)), max_size=24))
    check(tok, detok, ids)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(exclude_categories=("Cs", "Co", "Cn")), max_size=40))
def test_random_text(tok, detok, text):
    check(tok, detok, tok.encode(text, add_special_tokens=False))


def test_wikitext(tok, detok, wikitext):
    paragraph = wikitext[:3000]
    check(tok, detok, tok.encode(paragraph, add_special_tokens=False))


def test_engine_text_matches_its_token_ids(default_engine):
    """Needs the engine to stream through make_detokenizer: a raw completion keeps the space that
    separates it from its prompt."""
    result = default_engine.generate("The capital of France is", chat_template=False, max_tokens=6,
                                     speculative="off")
    assert result.finish_reason == "length"
    assert result.text == default_engine.tokenizer.decode(result.token_ids)
    assert result.text.startswith(" ")
