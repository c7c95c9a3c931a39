"""Streaming detokenizers whose text is exactly `tokenizer.decode(token_ids)`.

mlx-lm picks a streaming detokenizer from the decoder in tokenizer.json, and two of its choices do
not agree with `decode`:

- `BPEStreamingDetokenizer` (byte-level BPE: SmolLM2, Llama 3, Qwen, every `gpt2` GGUF vocabulary)
  drops the leading space of the first token, so `' Paris.'` streams as `'Paris.'`, and it reads
  the token of byte 0x00 as the character 'Ā'.
- `SPMStreamingDetokenizer` (SentencePiece with byte fallback: Gemma, Llama 2) joins all bytes and
  decodes them at once, while the tokenizers library decodes each run of byte tokens on its own and
  replaces a run that is not valid UTF-8 by one U+FFFD per byte; it also turns a '▁' spelled by
  byte tokens into a space.

The two classes here follow the tokenizers library's decoders (`ByteLevel`; `Replace('▁', ' ')`,
`ByteFallback`, `Fuse`, optionally `Strip(' ', 1, 0)`) instead. Both keep mlx-lm's
`StreamingDetokenizer` interface (`reset`, `add_token`, `finalize`, `text`, `tokens`,
`last_segment`), and `text` is always a prefix of the final text that never ends in a broken
UTF-8 sequence: bytes that may still complete a character are held back until they do.
"""

import codecs
import json
from typing import List, Optional, Sequence

from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer, StreamingDetokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

#: What the tokenizers library puts in place of bytes that are not UTF-8.
REPLACEMENT = "\ufffd"
#: SentencePiece's word-boundary mark, decoded as a space.
SPM_SPACE = "\u2581"
#: The decoder chain of a SentencePiece vocabulary with byte fallback (mlx-lm's "SPM" decoders).
_SPM_CHAIN = [
    {"type": "Replace", "pattern": {"String": SPM_SPACE}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
]
_SPM_STRIP = {"type": "Strip", "content": " ", "start": 1, "stop": 0}


def _utf8_decoder():
    """An incremental UTF-8 decoder: complete characters out, an unfinished one kept for later."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


class ByteLevelDetokenizer(StreamingDetokenizer):
    """Byte-level BPE (GPT-2 style, arXiv 1508.07909 with bytes as the base alphabet).

    Each token's characters stand for bytes through GPT-2's byte-to-unicode table; a token with a
    character outside the table (an added token such as "<x y>") stands for its own UTF-8 bytes, as
    the tokenizers library's ByteLevel decoder does. The bytes of all tokens form one stream,
    decoded with U+FFFD for invalid sequences (Python's "replace" and Rust's `from_utf8_lossy`
    agree on where).

    Args:
        tokens: the token string of each id (None for an id with no token, decoded as nothing).
    """

    def __init__(self, tokens: Sequence[Optional[str]]):
        char_bytes = {c: b for b, c in bytes_to_unicode().items()}
        self._pieces = [_byte_level_bytes(t, char_bytes) for t in tokens]
        self.reset()

    def reset(self):
        self.offset = 0
        self.text = ""
        self.tokens: List[int] = []
        self._utf8 = _utf8_decoder()

    def add_token(self, token: int):
        self.tokens.append(token)
        self.text += self._utf8.decode(self._piece(token))

    def finalize(self):
        self.text += self._utf8.decode(b"", final=True)

    def _piece(self, token: int) -> bytes:
        return self._pieces[token] if 0 <= token < len(self._pieces) else b""


def _byte_level_bytes(token: Optional[str], char_bytes: dict) -> bytes:
    if token is None:
        return b""
    if all(c in char_bytes for c in token):
        return bytes(char_bytes[c] for c in token)
    return token.encode("utf-8")


class SentencePieceDetokenizer(StreamingDetokenizer):
    """SentencePiece (arXiv 1808.06226) with byte fallback tokens `<0xNN>`.

    A text token decodes to its piece with '▁' as a space. A maximal run of consecutive byte tokens
    decodes to its UTF-8 text when the run is valid UTF-8, else to one U+FFFD per byte token (the
    tokenizers library's ByteFallback rule), so a run is held back until a text token or
    `finalize` closes it. With `strip`, one leading space of the whole text is dropped (the
    `Strip` decoder of vocabularies that prepend a space to the input, such as Llama 2).

    Args:
        tokens: the token string of each id (None for an id with no token, decoded as nothing).
        strip: drop the first character of the text when it is a space.
    """

    def __init__(self, tokens: Sequence[Optional[str]], strip: bool = False):
        self._bytes = [_fallback_byte(t) for t in tokens]
        self._pieces = ["" if t is None else t.replace(SPM_SPACE, " ") for t in tokens]
        self._strip = strip
        self.reset()

    def reset(self):
        self.offset = 0
        self.text = ""
        self.tokens: List[int] = []
        self._run = bytearray()  # bytes of the byte tokens since the last text token
        self._started = False  # whether the text has begun (the strip applies once)

    def add_token(self, token: int):
        self.tokens.append(token)
        if not 0 <= token < len(self._pieces):
            return  # an id the vocabulary does not have decodes to nothing
        byte = self._bytes[token]
        if byte is not None:
            self._run.append(byte)
            return
        self._close_run()
        self._emit(self._pieces[token])

    def finalize(self):
        self._close_run()

    def _close_run(self):
        if not self._run:
            return
        try:
            text = self._run.decode("utf-8")
        except UnicodeDecodeError:
            text = REPLACEMENT * len(self._run)
        self._run.clear()
        self._emit(text)

    def _emit(self, text: str):
        if not self._started and text:
            self._started = True
            if self._strip and text[0] == " ":
                text = text[1:]
        self.text += text


def _fallback_byte(token: Optional[str]) -> Optional[int]:
    """The byte of a byte-fallback token '<0xNN>', else None (the tokenizers library's test)."""
    if token is None or len(token) != 6 or not token.startswith("<0x") or not token.endswith(">"):
        return None
    try:
        return int(token[3:5], 16)
    except ValueError:
        return None


def decoder_description(tokenizer) -> Optional[dict]:
    """The JSON description of a fast tokenizer's decoder (as in tokenizer.json), or None."""
    decoder = tokenizer.backend_tokenizer.decoder
    return None if decoder is None else json.loads(decoder.__getstate__())


def make_detokenizer(tokenizer) -> StreamingDetokenizer:
    """A streaming detokenizer whose final text is `tokenizer.decode(ids)` for every id sequence.

    Build it once per tokenizer (it reads the whole vocabulary), `reset()` it per request.

    Args:
        tokenizer: a Hugging Face fast tokenizer, or mlx-lm's TokenizerWrapper around one.

    Returns:
        `ByteLevelDetokenizer` for a ByteLevel decoder, `SentencePieceDetokenizer` for SentencePiece
        with byte fallback; for any other decoder (or a tokenizer that cleans up spaces when
        decoding), mlx-lm's `NaiveStreamingDetokenizer`, which decodes with the tokenizer itself.
    """
    description = decoder_description(tokenizer)
    if tokenizer.clean_up_tokenization_spaces or description is None:
        return NaiveStreamingDetokenizer(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    if description.get("type") == "ByteLevel":
        return ByteLevelDetokenizer(tokens)
    if description == {"type": "Sequence", "decoders": _SPM_CHAIN}:
        return SentencePieceDetokenizer(tokens)
    if description == {"type": "Sequence", "decoders": [*_SPM_CHAIN, _SPM_STRIP]}:
        return SentencePieceDetokenizer(tokens, strip=True)
    return NaiveStreamingDetokenizer(tokenizer)
