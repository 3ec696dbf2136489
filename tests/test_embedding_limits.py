"""Issue 50: an embedding input longer than the model takes (all-MiniLM-L6-v2: 256
tokens) is a 400 naming the limit, not silently cut; truncate_prompt_tokens (vLLM's
extension, sent by the openai client in extra_body) cuts it on request, and usage
counts the tokens embedded."""

from __future__ import annotations

import numpy as np
import openai
import pytest

EMBED = "all-minilm-l6-v2"
LONG = "word " * 2000  # 2002 tokens with [CLS] and [SEP]


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.mark.parametrize(
    ("inputs", "where"), [(LONG, ""), (["short", LONG], " in input[1]"), ([[7] * 300], "")]
)
def test_an_input_past_the_limit_is_a_400_naming_it(client, inputs, where):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=EMBED, input=inputs)
    err = caught.value.body
    assert (err["param"], err["code"]) == ("input", "context_length_exceeded"), err
    n = 300 if isinstance(inputs[0], list) else 2002
    assert err["message"].startswith(
        f"This model's maximum context length is 256 tokens, however you requested {n} "
        f"tokens{where}."
    ), err


def test_truncate_prompt_tokens_embeds_the_first_tokens(client):
    def embed(inputs, keep):
        return client.embeddings.create(
            model=EMBED, input=inputs, extra_body={"truncate_prompt_tokens": keep}
        )

    whole = embed([LONG, "short"], -1)  # -1: the model's maximum
    assert whole.usage.prompt_tokens == 256 + 3  # "short" is whole: [CLS] short [SEP]
    at_limit = embed(LONG, 256)
    np.testing.assert_allclose(whole.data[0].embedding, at_limit.data[0].embedding, atol=1e-6)
    # the first 10 tokens: [CLS], 8 words, [SEP], the same as those 8 words
    ten = embed(LONG, 10)
    assert ten.usage.prompt_tokens == 10
    eight_words = client.embeddings.create(model=EMBED, input="word " * 8)
    np.testing.assert_allclose(ten.data[0].embedding, eight_words.data[0].embedding, atol=1e-6)
    assert embed([[7] * 300], 5).usage.prompt_tokens == 5  # token ids: the first 5


@pytest.mark.parametrize("keep", [257, 2, 0])
def test_a_truncate_prompt_tokens_that_cannot_be_kept_is_a_400_naming_it(client, keep):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(
            model=EMBED, input=LONG, extra_body={"truncate_prompt_tokens": keep}
        )
    assert caught.value.body["param"] == "truncate_prompt_tokens", caught.value.body
