"""Small pieces on their own: stop matching, streaming decode, sampling, backoff, config."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni.engine.checkpoint import Checkpoint
from omni.engine.sampling import SamplingParams, apply_penalties, make_generator, sample
from omni.engine.stops import StopMatcher
from omni.engine.tokenizer import TextTokenizer
from omni.runtime.catalog import CatalogError, ModelEntry, load_config
from omni.runtime.instance import Backoff


def feed_all(stops: list[str], deltas: list[str]) -> tuple[str, bool, list[str]]:
    matcher = StopMatcher(stops)
    emitted = []
    for delta in deltas:
        text, hit = matcher.feed(delta)
        emitted.append(text)
        if hit:
            return "".join(emitted), True, emitted
    emitted.append(matcher.flush())
    return "".join(emitted), False, emitted


def test_stop_split_across_deltas_is_held_back():
    text, hit, emitted = feed_all(["STOP"], ["abc S", "T", "OP xyz"])
    assert (text, hit) == ("abc ", True)
    assert emitted == ["abc ", "", ""]


def test_false_alarm_prefix_is_released():
    text, hit, emitted = feed_all(["STOP"], ["abc ST", "ART"])
    assert (text, hit) == ("abc START", False)
    assert emitted[0] == "abc "


def test_the_stop_that_completes_first_wins():
    assert feed_all(["c", "ab"], ["xab", "c"])[:2] == ("x", True)
    assert feed_all(["S", "aSS"], ["aSS"])[:2] == ("a", True)  # "S" completes before "aSS"
    assert feed_all(["S", "aSS"], ["aS", "S"])[:2] == ("a", True)  # however it arrives


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abcS", max_size=30),
    stops=st.lists(st.text(alphabet="abcS", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=6),
)
def test_stop_matching_equals_whole_string_search(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out, hit, emitted = feed_all(stops, deltas)
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]  # first to complete
    assert (out, hit) == ((text[: min(hits)[1]], True) if hits else (text, False))
    assert not any(s in "".join(emitted) for s in stops)


def test_stream_decoder_reassembles_multibyte_text(text_model_dir):
    tok = TextTokenizer(Checkpoint.open(text_model_dir))
    text = "naïve café 🚀🚀 日本語のテキスト — done."
    decoder = tok.stream_decoder()
    deltas = [decoder.push(t) for t in tok.encode(text)]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_greedy_and_degenerate_filters_pick_argmax():
    logits = torch.randn(1000)
    best = int(torch.argmax(logits))
    gen = make_generator(0)
    assert sample(logits, SamplingParams(temperature=0), gen) == best
    assert sample(logits, SamplingParams(temperature=1, top_k=1), gen) == best
    assert sample(logits, SamplingParams(temperature=1, top_p=1e-6), gen) == best


def test_seeded_sampling_repeats_and_follows_the_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0, -10.0])
    params = SamplingParams(temperature=1.0)
    draws = [sample(logits, params, make_generator(s)) for s in range(4000)]
    assert draws[:50] == [sample(logits, params, make_generator(s)) for s in range(50)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    torch.testing.assert_close(freq, torch.softmax(logits, 0), atol=0.03, rtol=0)


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, top_p=0.7)  # nucleus: tokens 0 and 1
    gen = make_generator(1)
    assert {sample(logits, params, gen) for _ in range(500)} == {0, 1}


def test_backoff_doubles_caps_and_resets_after_stable_uptime():
    b = Backoff(initial_s=0.5, max_s=4, stable_s=60)
    assert [b.next_delay(1) for _ in range(6)] == [0.5, 1, 2, 4, 4, 4]
    assert b.next_delay(120) == 0.5


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("models = 3", "'models' must be an array"),
        ("[[models]]\nname = 'x'", r"models\[0\].path: required string"),
        ("[[models]]\nname = 'x'\npath = '/x'\nquota = 1", r"models\[0\].quota: only with 'gpu'"),
        ("[[models]]\nname = 'x'\npath = '/x'\nbudget = 1", r"models\[0\]: unknown key 'budget'"),
        ("[[models]]\nname = 'x'\npath = '/x'\ngpu = 0", r"models\[0\].gpu: GPU 0 has no"),
        (
            "[[gpus]]\nindex = 0\nbudget = '1GiB'\n[[models]]\nname = 'x'\npath = '/x'\ngpu = 0",
            r"models\[0\].quota: required with 'gpu'",
        ),
        (
            "[[gpus]]\nindex = 0\nbudget = '1GiB'\n"
            "[[models]]\nname = 'x'\npath = '/x'\ngpu = 0\nquota = '2GiB'",
            r"models\[0\].quota: larger than the budget of GPU 0",
        ),
        ("[[gpus]]\nindex = 0\nbudget = 'lots'", r"gpus\[0\].budget: 'lots' is not a size"),
        ("[[gpus]]\nindex = 0", r"gpus\[0\].budget: required"),
        ("[[models]]\nname = 'x'\npath = '/x'\nruntime = 'vllm'", r"models\[0\].runtime"),
        ("[[models]]\nname = 'x'\npath = '/x'\npermits = 0", r"models\[0\].permits"),
        ("[[models]]\nname = 'x'\npath = '/x'\ncold = true", r"models\[0\].cold: only with"),
        ("[[models]]\nname = 'x'\npath = '/x'\ntool_parser = 'xml'", r"models\[0\].tool_parser"),
        ("[[models]]\nname = 'x'\npath = '/x'\ntensor_parallel = 0", r"\[0\].tensor_parallel"),
        (
            "[[gpus]]\nindex = 0\nbudget = '1GiB'\n[[models]]\nname = 'x'\npath = '/x'\n"
            "gpu = 0\nquota = '1GiB'\ntensor_parallel = 2",
            r"models\[0\].tensor_parallel: 2 ranks on 1 GPU\(s\)",
        ),
        (
            "[[gpus]]\nindex = 0\nbudget = '1GiB'\n[[models]]\nname = 'x'\npath = '/x'\n"
            "gpu = [0, 1]\nquota = '1GiB'",
            r"models\[0\].gpu: GPU 1 has no \[\[gpus\]\] entry",
        ),
        ("[[models]]\nname = 'x'\npath = '/x'\ngpu = [0, 0]", r"models\[0\].gpu: .* twice"),
        ("[[models]]\nname = 'x'\npath = '/x'\ngpu = []", r"models\[0\].gpu: a GPU index"),
        ("[[models]]\nname = 'x'\npath = '/x'\nparallel = 'dp'", r"models\[0\].parallel: 'dp'"),
        ("[[models]]\nname = 'x'\npath = '/x'\nparallel = 'ep'", r"'ep' needs several ranks"),
        ("[[models]]\nname = 'x'\npath = '/x'\nquantization = 'fp8'", r"FP8 needs a GPU"),
        ("[[models]]\nname = 'x'\npath = '/x'\nquantization = 'int4'", r"'int4' is not 'fp8'"),
        ("[[models]]\nname = 'x'\npath = '/x'\nkv_cache_dtype = 'fp8'", r"FP8 cache needs a GPU"),
        ("[[models]]\nname = 'x'\npath = '/x'\nkv_cache_dtype = 'e5m2'", r"'e5m2' is not 'fp8'"),
        ("default_models = 'yes'", "'default_models' must be true or false"),
        ("listen = 1", "'listen' must be 'host:port'"),
        ("listen = 'localhost'", "'listen' must be 'host:port'"),
        ("swap_timeout = -1", "'swap_timeout' must be a positive number"),
        ("gpu_yield = 2", "'gpu_yield' must be seconds from 0"),
        ("gpu_yield = true", "'gpu_yield' must be seconds from 0"),
        ("state_dir = 'relative'", "'state_dir' must be an absolute path"),
        ("sandbox = 'none'", "'sandbox' must be"),
        ("colour = 'blue'", "unknown key 'colour'"),
        ("[[models]\n", "invalid TOML"),
    ],
)
def test_config_errors_name_the_key(tmp_path, toml, message):
    path = tmp_path / "omnid.toml"
    path.write_text(toml)
    with pytest.raises(CatalogError, match=message):
        load_config(path)


def test_model_names_are_checked(text_model_dir):
    assert ModelEntry.from_path("ok-name_1.0", text_model_dir, "admin").kind == "generate"
    for bad in ("", "../escape", "a/b", "x" * 65, "-leading"):
        with pytest.raises(CatalogError, match="is invalid"):
            ModelEntry.from_path(bad, text_model_dir, "admin")


def test_a_model_names_its_tool_parser(tmp_path):
    path = tmp_path / "omnid.toml"
    path.write_text("[[models]]\nname = 'a'\npath = '/x'\ntool_parser = 'llama3'\n")
    assert load_config(path).models[0].tool_parser == "llama3"


def test_a_model_asks_for_fp8_weights_and_kv_cache(tmp_path):
    path = tmp_path / "omnid.toml"
    path.write_text(
        "[[gpus]]\nindex = 0\nbudget = '8GiB'\n[[models]]\nname = 'a'\npath = '/x'\ngpu = 0\n"
        "quota = '4GiB'\nquantization = 'fp8'\nkv_cache_dtype = 'fp8'\n"
    )
    placement = load_config(path).models[0].placement
    assert (placement.quantization, placement.kv_cache_dtype) == ("fp8", "fp8")


def test_duplicate_config_names_are_refused(tmp_path):
    path = tmp_path / "omnid.toml"
    path.write_text("[[models]]\nname = 'a'\npath = '/x'\n[[models]]\nname = 'a'\npath = '/y'\n")
    with pytest.raises(CatalogError, match=r"models\[1\]\.name: 'a' is already listed"):
        load_config(path)


def draws(logits, params, n=600) -> set[int]:
    gen = make_generator(3)
    return {sample(logits, params, gen) for _ in range(n)}


def test_top_k_and_min_p_keep_only_the_likely_tokens():
    logits = torch.randn(50)
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert draws(logits, SamplingParams(temperature=1.0, top_k=3)) <= top3
    # min_p 0.3: tokens 0-2 are within 0.3 of the best one's probability, the tail is not
    tail = torch.rand(47) - 4.0
    designed = torch.cat([torch.tensor([2.0, 1.9, 1.5]), tail])
    assert draws(designed, SamplingParams(temperature=1.0, min_p=0.3)) == {0, 1, 2}


def test_penalties_change_exactly_the_seen_tokens():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), [0], [1])
    torch.testing.assert_close(out, torch.tensor([1.0, -2.0, 0.5, 3.0, -2.0]))
    out = apply_penalties(
        logits, SamplingParams(presence_penalty=0.5, frequency_penalty=1.0), [3], [2, 2, 4]
    )
    torch.testing.assert_close(out, torch.tensor([2.0, -1.0, -2.0, 3.0, -3.5]))  # not the prompt


def test_greedy_with_a_repetition_penalty_avoids_the_seen_token():
    logits = torch.tensor([1.0, 5.0, 4.0])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, SamplingParams(temperature=0), make_generator(0)) == 1
    assert sample(logits, params, make_generator(0), prompt=[1]) == 2  # 5/2 < 4


def test_an_instance_whose_process_exits_stops_reading_live_before_its_teardown(tmp_path):
    """The state leaves starting/ready as soon as the process is gone: the sandbox's
    teardown, the last output and the GPU's release all come before the backoff, and a
    status read then said "ready" with no process behind it."""
    import asyncio
    import sys
    import time
    from dataclasses import replace

    from omni.isolation.sandbox import ProcessSandbox
    from omni.runtime.instance import Instance, State

    class SlowTeardown(ProcessSandbox):
        async def wait(self):
            await asyncio.sleep(1.5)
            return await super().wait()

    def factory(spec):
        return SlowTeardown(replace(spec, argv=[sys.executable, "-c", "pass"]))

    async def go():
        entry = ModelEntry("quick", tmp_path, "generate", "admin")
        inst = Instance(entry, tmp_path / "instances", factory, Backoff(initial_s=5, max_s=5))
        inst.start()
        deadline = time.monotonic() + 20
        while inst.state in (State.STOPPED, State.STARTING):  # (stopped: not yet begun)
            assert time.monotonic() < deadline, inst.to_json()
            await asyncio.sleep(0.01)
        seen, restarts = inst.state, inst.restarts
        while inst.state != State.BACKOFF:
            assert time.monotonic() < deadline, inst.to_json()
            await asyncio.sleep(0.01)
        last_exit = inst.last_exit
        await inst.stop()
        return seen, restarts, last_exit

    seen, restarts, last_exit = asyncio.run(go())
    assert (seen, restarts) == (State.STOPPING, 0)  # before the teardown had returned
    assert last_exit == "exited (code 0)"
