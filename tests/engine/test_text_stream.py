"""The text stream's incremental decoding (the tokenizers library's DecodeStream) against decoding
every token so far at each step (what it replaced): the same deltas, the same character counts
for logprobs, the same stops, on the default model's byte-level tokenizer and on a
sentencepiece-style one (Metaspace, byte fallback), over real text and random token ids (which
include bytes that never make a character)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from gateway.engine.model_info import special_ids
from gateway.engine.sequence import TextStream

pytestmark = pytest.mark.model_free  # no model, no server: in the fast subset

TEXT = ("Hello, wörld! 你好，世界 🎉🎉 naïve café — «quotes» ∑x² \n\tdef f(x):\n    return x ** 2\n"
        "The order #A-1042 shipped on 2026-11-25; refund: $12.50 (ok?). Ünïcödé ✓✗ 𝔘𝔫𝔦 👩‍👩‍👧 ")


class Counting:
    """A tokenizer whose `decode` calls are counted (the stream should not need any)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.clean_up_tokenization_spaces = tokenizer.clean_up_tokenization_spaces
        self.decodes = 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        self.decodes += 1
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))


class WholeDecode:
    """Only `decode`: the stream decodes every token so far at each step, as it used to."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))


@pytest.fixture(scope="module")
def smollm(tokenizer_dir: Any) -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def metaspace() -> Any:
    """A Llama-2-style tokenizer trained here: Metaspace pre-tokenizer, byte fallback, a decoder
    that strips the first space."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    trained.train_from_iterator([TEXT] * 20, trainer)
    spec = json.loads(trained.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):  # sentencepiece's byte tokens, for what the vocabulary cannot spell
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["added_tokens"].append({"id": len(vocab), "content": "[TOOL_CALLS]", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", clean_up_tokenization_spaces=False)


def sequences(tokenizer: Any) -> list[list[int]]:
    """Real text (whole, and from inside a word), then random ids with special tokens among them."""
    real = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    vocab = len(tokenizer)
    specials = sorted(special_ids(tokenizer))
    randoms = [[rng.choice(specials) if rng.random() < 0.05 else rng.randrange(vocab) for _ in range(120)]
               for _ in range(6)]
    return [real, real[3:], *randoms]


def run(stream: TextStream, ids: list[int]) -> list[tuple[str, int, bool]]:
    out = []
    for token in ids:
        out.append((stream.push(token), stream.text_chars, stream.stopped))
        if stream.stopped:
            break
    out.append((stream.flush(), stream.text_chars, stream.stopped))
    return out


@pytest.mark.parametrize("name", ["smollm", "metaspace"])
@pytest.mark.parametrize("keep", [False, True])
def test_the_stream_writes_what_decoding_every_token_again_writes(request, name, keep):
    tokenizer = request.getfixturevalue(name)
    specials = special_ids(tokenizer)
    keep_ids = frozenset(sorted(specials)[-1:]) if keep else frozenset()  # kept in the text, as a tool-call marker is
    for index, ids in enumerate(sequences(tokenizer)):
        counting = Counting(tokenizer)
        fast = run(TextStream(counting, (), specials, keep_ids), ids)
        whole = run(TextStream(WholeDecode(tokenizer), (), specials, keep_ids), ids)
        assert fast == whole
        if index < 2:  # real text: streamed, and the text decoded at once. Random byte tokens may
            # be neither: a byte that reads as "A" alone may turn out to begin an invalid run, which
            # decodes as U+FFFD whole, and the stream then decodes every token again (as `whole`)
            assert counting.decodes <= 1  # one at the end, for a character never completed
            visible = [t for t in ids if t not in specials - keep_ids]
            text = "".join(delta for delta, _, _ in fast)
            assert text == tokenizer.decode(visible if keep else ids, skip_special_tokens=not keep)


@pytest.mark.parametrize("name", ["smollm", "metaspace"])
def test_stop_sequences_cut_the_stream_where_they_cut_the_whole_text(request, name):
    tokenizer = request.getfixturevalue(name)
    specials = special_ids(tokenizer)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    for stop in (("world", "café"), ("ö",), ("def f", "x **"), ("👧",), ("not in the text",)):
        fast = TextStream(tokenizer, stop, specials)
        whole = TextStream(WholeDecode(tokenizer), stop, specials)
        assert run(fast, ids) == run(whole, ids)
        assert fast.stopped_by == whole.stopped_by and fast.stopped == (stop != ("not in the text",))


CALL_TEXT = 'Let me look: "a" {b}.<tool_call>\n{"name": "get_gmv", "arguments": {"period": "last week"}}\n</tool_call>'


@pytest.mark.parametrize("stop", [('"',), ("{",), ("period",), ("</tool_call>",), ('", "arguments',)])
def test_stop_sequences_never_cut_a_tool_call_only_the_text_before_it(smollm, stop):
    """A stop sequence that matches only inside the call section (after its trigger) does not stop
    the stream: the grammar holds the call to its schema, and cut it would be arguments that are
    not JSON, reported as a call. One that matches in the text before the trigger stops it there."""
    ids = smollm(CALL_TEXT, add_special_tokens=False)["input_ids"]
    stream = TextStream(smollm, stop, special_ids(smollm), stop_before="<tool_call>")
    text = "".join(delta for delta, _, _ in run(stream, ids))
    whole_text = TextStream(smollm, stop, special_ids(smollm))
    cut = "".join(delta for delta, _, _ in run(whole_text, ids))
    before = CALL_TEXT[: CALL_TEXT.index("<tool_call>")]
    if stop[0] in before:  # it matches before the call: the same cut as without stop_before
        assert stream.stopped and text == cut == before[: before.index(stop[0])]
    else:
        assert not stream.stopped and text == CALL_TEXT and cut != CALL_TEXT


@pytest.mark.parametrize("stop", [('"',), ("{",), ("Let",)])
def test_stop_sequences_never_apply_to_output_that_starts_inside_a_forced_call(smollm, stop):
    ids = smollm(CALL_TEXT, add_special_tokens=False)["input_ids"]
    stream = TextStream(smollm, stop, special_ids(smollm), stop_before="")
    assert "".join(delta for delta, _, _ in run(stream, ids)) == CALL_TEXT and not stream.stopped
