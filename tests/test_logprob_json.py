"""Log-probabilities written as JSON text (serve/logprob_json.py), read back with json.loads: OpenAI's
shapes, each token named by its own text and bytes (runtime/text.py's TokenPieces), the numbers as
they were, a completion's text offsets carried from output to output. The values themselves are
checked against transformers through the server (tests/test_server.py)."""

import json
import random

import pytest
from servers import SHIPPED

from runtime.text import TokenPieces, load_tokenizer
from serve.logprob_json import LogprobsWriter, TokenNames


@pytest.fixture(scope="module")
def pieces():
    return TokenPieces(load_tokenizer(SHIPPED))


def read(written) -> dict:
    """What a client reads: chat's JSON text, or a completion's dict as the chunk's json.dumps writes it."""
    return json.loads(written if isinstance(written, str) else json.dumps(written))


def outputs(seed: int, vocab: int) -> list[tuple[list[int], list]]:
    """Outputs of 1-3 tokens each, 5 top entries a token; ids from the whole vocabulary (byte pieces
    of a character, special tokens), values of every size, a top list that repeats a token."""
    rng = random.Random(seed)
    values = [-0.0, -1e-12, -0.5, -3.25, -17.0625, -1e3, -123456.789]
    result = []
    for _ in range(40):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        logprobs = []
        for _ in ids:
            top = [rng.randrange(vocab) for _ in range(5)]
            if rng.random() < 0.2:
                top[4] = top[0]
            logprobs.append((rng.choice(values), top, sorted((rng.choice(values) for _ in range(5)), reverse=True)))
        result.append((ids, logprobs))
    return result


def test_chat_entries_name_each_token_and_keep_every_value(pieces):
    writer = LogprobsWriter(TokenNames(pieces), chat=True)
    for ids, logprobs in outputs(0, len(pieces.tokenizer)):
        got = read(writer(ids, logprobs))
        assert list(got) == ["content"] and len(got["content"]) == len(ids)
        for entry, token, (logprob, top_ids, top_values) in zip(got["content"], ids, logprobs):
            assert entry == {"token": pieces(token)[0], "logprob": logprob, "bytes": pieces(token)[1],
                             "top_logprobs": [{"token": pieces(i)[0], "logprob": v, "bytes": pieces(i)[1]}
                                              for i, v in zip(top_ids, top_values)]}


def test_completion_entries_and_their_text_offsets_across_outputs(pieces):
    writer = LogprobsWriter(TokenNames(pieces), chat=False)
    offset = 0
    for ids, logprobs in outputs(1, len(pieces.tokenizer)):
        got = read(writer(ids, logprobs))
        assert list(got) == ["tokens", "token_logprobs", "top_logprobs", "text_offset"]
        assert got["tokens"] == [pieces(t)[0] for t in ids]
        assert got["token_logprobs"] == [lp for lp, _, _ in logprobs]
        for top, (_, top_ids, top_values) in zip(got["top_logprobs"], logprobs):
            expected = {}
            for i, v in zip(top_ids, top_values):  # one key per text, as a dict keeps it: the later value
                expected[pieces(i)[0]] = v
            assert top == expected
        starts = []
        for t in ids:
            starts.append(offset)
            offset += len(pieces(t)[0])
        assert got["text_offset"] == starts


def test_a_value_that_is_not_finite_is_written_as_json_dumps_writes_it(pieces):
    writer = LogprobsWriter(TokenNames(pieces), chat=False)
    text = json.dumps(writer([5], [(float("-inf"), [5, 6], [-0.25, float("-inf")])]))
    assert '"token_logprobs": [-Infinity]' in text
    assert json.loads(text)["top_logprobs"][0][pieces(6)[0]] == float("-inf")
    chat = LogprobsWriter(TokenNames(pieces), chat=True)([5], [(float("-inf"), [6], [float("nan")])])
    assert '"logprob": -Infinity' in chat and '"logprob": NaN' in chat
    assert writer([5], None) is None
