"""The worker around a third-party handler, in one process: dynamic batching (real
threads, a real event loop), the checks of what a handler returns, the settings document
omnid passes, and the catalog's keys for a python-runtime model."""

from __future__ import annotations

import asyncio
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from omni.instance.batcher import Batcher, InferError
from omni.instance.handler import HandlerError, TensorSpec, each, together
from omni.instance.settings import InstanceSettings, SettingsError
from omni.instance.validate import TensorError, check_inputs, check_outputs
from omni.runtime import catalog

OUT = (TensorSpec("y", "FP32", (-1,)), TensorSpec("s", "BYTES", (1,)))
LIMIT = 1 << 20


def bytes_array(*items: bytes) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = list(items)
    return out


def ok_outputs(n: int = 3) -> dict:
    return {"y": np.arange(n, dtype=np.float32), "s": bytes_array(b"hi")}


# ---- outputs are checked against their declaration -----------------------------------


def test_outputs_that_match_their_declaration_pass():
    out = check_outputs(ok_outputs(5), OUT, LIMIT)
    assert out["y"].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("outputs", "says"),
    [
        ([1, 2], "not a dict"),
        ({"y": np.zeros(3, np.float32)}, "missing output 's'"),
        ({**ok_outputs(), "z": np.zeros(1)}, "undeclared output 'z'"),
        ({**ok_outputs(), "y": [1.0, 2.0]}, "'y' is a list, not a numpy array"),
        ({**ok_outputs(), "y": np.zeros(3, np.float64)}, "'y' has dtype float64, not FP32"),
        ({**ok_outputs(), "y": np.zeros((3, 1), np.float32)}, "'y' has shape [3, 1], not [-1]"),
        ({**ok_outputs(), "s": bytes_array(b"a", b"b")}, "'s' has shape [2], not [1]"),
        ({**ok_outputs(), "s": np.array(["text"], dtype=object)}, "holds a str, not bytes"),
        ({**ok_outputs(), "y": np.zeros(LIMIT, np.float32)}, "limit of a response"),
        ({**ok_outputs(), "s": bytes_array(b"x" * LIMIT)}, "limit of a response"),
    ],
)
def test_an_output_unlike_its_declaration_is_refused_by_name(outputs, says):
    with pytest.raises(TensorError, match=says.replace("[", r"\[").replace("]", r"\]")):
        check_outputs(outputs, OUT, LIMIT)


def test_inputs_are_checked_before_a_handler_sees_them():
    specs = (TensorSpec("x", "INT64", (2, -1)),)
    check_inputs({"x": np.zeros((2, 7), np.int64)}, specs)
    with pytest.raises(TensorError, match="missing input 'x'"):
        check_inputs({}, specs)
    with pytest.raises(TensorError, match="unknown input 'q'"):
        check_inputs({"x": np.zeros((2, 1), np.int64), "q": np.zeros(1)}, specs)
    with pytest.raises(TensorError, match="shape"):
        check_inputs({"x": np.zeros((3, 1), np.int64)}, specs)


def test_a_spec_must_name_a_protocol_datatype():
    with pytest.raises(ValueError, match="FLOAT"):
        TensorSpec("x", "FLOAT", (1,))


# ---- dynamic batching ------------------------------------------------------------------


class Recorder:
    """A handler's infer(): adds 1, remembers each batch's size and thread, and may be
    held until the test lets it go."""

    def __init__(self, hold: threading.Event | None = None):
        self.sizes: list[int] = []
        self.threads: set[str] = set()
        self.hold = hold

    def __call__(self, batch: list[dict]) -> list[dict]:
        if self.hold is not None:
            self.hold.wait(10)
        self.sizes.append(len(batch))
        self.threads.add(threading.current_thread().name)
        return [{"y": r["x"] + 1, "s": r["s"]} for r in batch]


def request(value: float) -> dict:
    return {"x": np.full(3, value, np.float32), "s": bytes_array(str(value).encode())}


def batcher(infer, **kw) -> Batcher:
    return Batcher(infer, partial(check_outputs, specs=OUT, max_bytes=LIMIT), **kw)


def test_concurrent_requests_are_merged_and_each_gets_its_own_answer():
    recorder = Recorder()

    async def main():
        b = batcher(recorder, max_batch_size=8, max_queue_delay_s=0.2)
        results = await asyncio.gather(*(b.submit(request(i)) for i in range(8)))
        alone = await b.submit(request(3))
        await b.close()
        return results, alone, b.stats()

    results, alone, stats = asyncio.run(main())
    assert recorder.sizes == [8, 1]  # merged into one infer(), then one alone
    for i, out in enumerate(results):
        assert out["y"].tolist() == [i + 1] * 3 and out["s"].tolist() == [str(i).encode()]
    # a request's answer does not depend on its batch-mates
    assert alone["y"].tolist() == results[3]["y"].tolist()
    assert stats["batch_runs"] == 2 and stats["batch_requests"] == 9
    assert stats["batch_sizes"] == {"1": 1, "8": 1}
    assert recorder.threads and "MainThread" not in recorder.threads  # off the event loop


def test_a_batch_holds_at_most_max_batch_size():
    recorder = Recorder()

    async def main():
        b = batcher(recorder, max_batch_size=3, max_queue_delay_s=0.2)
        await asyncio.gather(*(b.submit(request(i)) for i in range(7)))
        await b.close()

    asyncio.run(main())
    assert sorted(recorder.sizes) == [1, 3, 3]


def test_the_queue_delay_bounds_the_wait_for_batch_mates():
    recorder = Recorder()

    async def main():
        b = batcher(recorder, max_batch_size=8, max_queue_delay_s=0.3)
        t0 = time.monotonic()
        await b.submit(request(1))
        waited = time.monotonic() - t0
        await b.close()
        return waited

    waited = asyncio.run(main())
    assert 0.25 <= waited < 2.0 and recorder.sizes == [1]


def test_a_request_whose_client_left_is_dropped_before_it_runs():
    hold = threading.Event()
    recorder = Recorder(hold)

    async def main():
        b = batcher(recorder, max_batch_size=1)
        first = asyncio.create_task(b.submit(request(1)))  # runs, held in infer()
        await asyncio.sleep(0.1)
        gone = asyncio.create_task(b.submit(request(2)))
        kept = asyncio.create_task(b.submit(request(3)))
        await asyncio.sleep(0.1)
        gone.cancel()  # its client disconnected while it waited
        hold.set()
        await first
        out = await kept
        await b.close()
        return out, b.stats()

    out, stats = asyncio.run(main())
    assert recorder.sizes == [1, 1]  # the cancelled one never reached infer()
    assert out["y"].tolist() == [4.0] * 3 and stats["batch_cancelled"] == 1


def failing(exc: Exception):
    def infer(batch):
        raise exc

    return infer


@pytest.mark.parametrize(
    ("infer", "status", "says"),
    [
        (failing(HandlerError("x must be positive")), 400, "x must be positive"),
        (failing(HandlerError()), 400, "the model refused the request"),
        (failing(ZeroDivisionError("boom")), 500, "ZeroDivisionError: boom"),
        (lambda batch: None, 500, "NoneType results for 1 requests"),
        (lambda batch: [{"y": 5}] * len(batch), 500, "invalid output"),
    ],
)
def test_a_handler_that_fails_every_request_fails_each_with_a_clear_error(infer, status, says):
    async def main():
        b = batcher(infer, max_batch_size=2, max_queue_delay_s=0.2)
        results = await asyncio.gather(
            b.submit(request(1)), b.submit(request(2)), return_exceptions=True
        )
        after = await asyncio.gather(b.submit(request(3)), return_exceptions=True)
        await b.close()
        return results, after, b

    results, after, b = asyncio.run(main())
    for error in [*results, *after]:
        assert isinstance(error, InferError) and error.status == status, error
        assert says in error.message, error.message
    assert b.hung is None  # it keeps serving
    assert b.stats()["batch_failed"] == 3


class NegativeIsBad:
    """A handler's infer() that adds 1, and fails a request whose x is negative in one
    of four ways: `returns` a HandlerError in its place, `raises` one for the batch,
    `crashes` (another exception, for the batch), or returns a `malformed` output."""

    def __init__(self, style: str):
        self.style = style
        self.calls: list[int] = []

    def __call__(self, batch: list[dict]) -> list:
        self.calls.append(len(batch))
        bad = [bool((r["x"] < 0).any()) for r in batch]
        if any(bad) and self.style == "raises":
            raise HandlerError("x must not be negative")
        if any(bad) and self.style == "crashes":
            raise ValueError("negative x")
        return [self.failure(r) if b else self.answer(r) for r, b in zip(batch, bad, strict=True)]

    def answer(self, r: dict) -> dict:
        return {"y": r["x"] + 1, "s": r["s"]}

    def failure(self, r: dict):
        if self.style == "returns":
            return HandlerError("x must not be negative")
        return {"y": r["x"]}  # malformed: no "s"


@pytest.mark.parametrize(
    ("style", "status", "says", "calls"),
    [
        ("returns", 400, "x must not be negative", [3]),
        ("raises", 400, "x must not be negative", [3, 1, 1, 1]),  # then each alone
        ("crashes", 500, "ValueError: negative x", [3, 1, 1, 1]),
        ("malformed", 500, "missing output 's'", [3]),
    ],
)
def test_one_bad_request_fails_alone_and_its_batch_mates_get_their_answers(
    style, status, says, calls
):
    handler = NegativeIsBad(style)

    async def main():
        b = batcher(handler, max_batch_size=3, max_queue_delay_s=0.2)
        submitted = (b.submit(request(v)) for v in (1, -1, 2))
        results = await asyncio.gather(*submitted, return_exceptions=True)
        await b.close()
        return results, b.stats()

    (first, bad, last), stats = asyncio.run(main())
    assert first["y"].tolist() == [2.0] * 3 and first["s"].tolist() == [b"1"]
    assert last["y"].tolist() == [3.0] * 3 and last["s"].tolist() == [b"2"]
    assert isinstance(bad, InferError) and bad.status == status and says in bad.message, bad
    assert handler.calls == calls
    assert stats["batch_runs"] == len(calls) and stats["batch_requests"] == sum(calls)
    assert stats["batch_sizes"] == {str(n): calls.count(n) for n in sorted(set(calls))}
    assert stats["batch_failed"] == 1 and stats["batch_cancelled"] == 0
    assert stats["batch_rerun"] == (3 if len(calls) > 1 else 0)


def test_a_batch_given_the_wrong_number_of_results_is_run_again_request_by_request():
    calls = []

    def first_only(batch):
        calls.append(len(batch))
        return [{"y": batch[0]["x"] + 1, "s": batch[0]["s"]}]

    async def main():
        b = batcher(first_only, max_batch_size=2, max_queue_delay_s=0.2)
        results = await asyncio.gather(b.submit(request(1)), b.submit(request(2)))
        await b.close()
        return results, b.stats()

    results, stats = asyncio.run(main())
    assert [r["y"].tolist() for r in results] == [[2.0] * 3, [3.0] * 3]
    assert calls == [2, 1, 1] and stats["batch_failed"] == 0 and stats["batch_rerun"] == 2


def test_a_request_that_hangs_when_run_again_alone_fails_the_rest_at_once():
    release = threading.Event()

    def refuse_then_hang(batch):
        if len(batch) > 1:
            raise HandlerError("one of these is bad")
        release.wait(30)
        return [ok_outputs()]

    async def main():
        b = batcher(refuse_then_hang, max_batch_size=2, max_queue_delay_s=0.2, infer_timeout_s=0.5)
        t0 = time.monotonic()
        results = await asyncio.gather(
            b.submit(request(1)), b.submit(request(2)), return_exceptions=True
        )
        took = time.monotonic() - t0
        release.set()
        await b.close()
        return results, took, b

    (hung, after), took, b = asyncio.run(main())
    assert isinstance(hung, InferError) and hung.status == 504, hung
    assert isinstance(after, InferError) and after.status == 503, after
    assert took < 3 and b.hung


def test_each_puts_a_refusal_in_its_items_place_and_passes_it_on():
    def positive(x: int) -> int:
        if x < 0:
            raise HandlerError(f"{x} is negative")
        return x

    steps = each(each([1, -2, 3], positive), lambda x: x * 10)
    assert steps[0::2] == [10, 30] and isinstance(steps[1], HandlerError)
    assert str(steps[1]) == "-2 is negative"
    with pytest.raises(ZeroDivisionError):  # only refusals are caught
        each([0], lambda x: 1 / x)


def test_together_runs_the_items_not_refused_at_once_and_keeps_each_in_its_place():
    runs = []

    def run(items: list[int]) -> list[int]:
        runs.append(items)
        return [x * 10 for x in items]

    refused = HandlerError("no")
    assert together([1, refused, 3], run) == [10, refused, 30] and runs == [[1, 3]]
    assert together([refused], run) == [refused] and len(runs) == 1  # nothing to run


def test_a_hung_handler_times_out_and_marks_the_instance_for_a_restart():
    release = threading.Event()

    def hang(batch):
        release.wait(30)
        return [ok_outputs() for _ in batch]

    async def main():
        b = batcher(hang, max_batch_size=1, infer_timeout_s=0.5)
        t0 = time.monotonic()
        first = asyncio.create_task(b.submit(request(1)))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(b.submit(request(2)))
        results = await asyncio.gather(first, queued, return_exceptions=True)
        took = time.monotonic() - t0
        later = await asyncio.gather(b.submit(request(3)), return_exceptions=True)
        release.set()
        await b.close()
        return results, later[0], took, b

    (first, queued), later, took, b = asyncio.run(main())
    assert isinstance(first, InferError) and first.status == 504, first
    assert "0.5 s timeout" in first.message
    assert isinstance(queued, InferError) and queued.status == 503  # not left waiting
    assert isinstance(later, InferError) and later.status == 503
    assert took < 3 and b.hung


# ---- the settings document -------------------------------------------------------------


def test_settings_survive_their_document_and_refuse_unknown_keys(monkeypatch):
    settings = InstanceSettings(
        "m",
        "/models/m",
        "/run/m/io/sock",
        runtime="python",
        handler="handler.py:Model",
        max_batch_size=4,
        speculative={"method": "ngram"},
        rank_controls=("/proc/1/fd/3", "/proc/1/fd/4"),
    )
    monkeypatch.setenv(*next(iter(settings.to_env().items())))
    assert InstanceSettings.from_env() == settings
    with pytest.raises(SettingsError, match="unknown key 'colour'"):
        InstanceSettings.from_json('{"name": "m", "model_dir": "/m", "socket": "/s", "colour": 1}')
    with pytest.raises(SettingsError, match="needs a handler"):
        InstanceSettings.from_json(
            '{"name": "m", "model_dir": "/m", "socket": "/s", "runtime": "python"}'
        )


# ---- the catalog -----------------------------------------------------------------------


def config(tmp_path: Path, model: str) -> Path:
    path = tmp_path / "omnid.toml"
    path.write_text(f'[[models]]\nname = "m"\npath = "/models/m"\n{model}\n')
    return path


def test_a_python_model_needs_a_handler_and_only_it_takes_handler_keys(tmp_path):
    good = 'runtime = "python"\nhandler = "handler.py:Model"\nmax_batch_size = 8\n'
    good += 'max_queue_delay_ms = 5\nrequirements = ["numpy==2.1.3"]\ninfer_timeout = 10'
    handler = catalog.load_config(config(tmp_path, good)).models[0].handler
    assert handler == catalog.HandlerConfig("handler.py:Model", ("numpy==2.1.3",), 8, 5.0, 10.0)
    off = catalog.load_config(config(tmp_path, good + "\ngpu_split = false")).models[0].handler
    assert off is not None and not off.gpu_split and handler.gpu_split
    for model, says in (
        ('runtime = "python"', "handler: required"),
        ('runtime = "python"\nhandler = "no-class"', "handler: required"),
        ('runtime = "python"\nhandler = "../up.py:M"', "handler: required"),
        ('handler = "handler.py:Model"', 'handler: only for runtime = "python"'),
        ('runtime = "python"\nhandler = "h.py:M"\nrequirements = ["numpy>=2"]', "exact version"),
        ('runtime = "python"\nhandler = "h.py:M"\nmax_batch_size = 0', "max_batch_size"),
        ('runtime = "python"\nhandler = "h.py:M"\ngpu_split = "no"', "gpu_split: must be"),
        ("gpu_split = false", 'gpu_split: only for runtime = "python"'),
        ('runtime = "triton"', "not one of"),
        (
            'runtime = "python"\nhandler = "h.py:M"\ntensor_parallel = 2',
            'only for runtime = "omni"',
        ),
    ):
        with pytest.raises(catalog.CatalogError, match=says):
            catalog.load_config(config(tmp_path, model))


def test_a_python_model_entry_needs_its_handler_file(tmp_path):
    handler = catalog.HandlerConfig("handler.py:Model")
    with pytest.raises(catalog.CatalogError, match="handler file"):
        catalog.ModelEntry.from_path("m", tmp_path, "config", handler=handler)
    (tmp_path / "handler.py").write_text("")
    entry = catalog.ModelEntry.from_path("m", tmp_path, "config", handler=handler)
    assert (entry.runtime, entry.kind, entry.handler) == ("python", "python", handler)


# ---- loading a handler -----------------------------------------------------------------


def test_a_handler_is_loaded_from_the_model_directory_or_a_module(tmp_path, monkeypatch):
    from omni.instance.python_backend import HandlerLoadError, load_handler_class

    code = "from omni.instance.handler import Handler\nclass H(Handler): pass\nclass N: pass\n"
    model = tmp_path / "model"
    model.mkdir()
    (model / "h.py").write_text(code)
    (tmp_path / "outside.py").write_text(code)
    assert load_handler_class("h.py:H", model).__name__ == "H"
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_handler_class("outside:H", model).__name__ == "H"  # a module on the path
    for spec, says in (
        ("../outside.py:H", "not a file in"),
        ("h.py:N", "not a Handler subclass"),
        ("h.py:Missing", "h.py has no 'Missing'"),
        ("h.py", "expected 'module:Class'"),
    ):
        with pytest.raises(HandlerLoadError, match=says):
            load_handler_class(spec, model)
