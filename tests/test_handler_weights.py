"""Which tensors a handler's worker declares read-only (Handler.weights(), omni/instance/
python_backend.py's declare_weights): its torch modules' parameters and buffers, found
among its attributes; nothing for a handler without torch models; and a handler whose
weights() fails still serves (its weights then move at every swap, as any memory)."""

from __future__ import annotations

import logging

import torch

from omni.instance.handler import Handler
from omni.instance.python_backend import declare_weights


class Modules(Handler):
    def load(self, model_dir, device):
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
        self.heads = [torch.nn.Linear(8, 2), torch.nn.Linear(8, 3)]
        self.parts = {"embed": torch.nn.Embedding(10, 4), "name": "not a module"}
        self.threshold = torch.ones(3)  # a bare tensor: the handler may write it
        self.labels = ["a", "b"]


class Plain(Handler):
    def load(self, model_dir, device):
        self.suffix = b"!"


class Failing(Modules):
    def weights(self):
        raise RuntimeError("handler code")


def pointers(tensors) -> set[int]:
    return {t.data_ptr() for t in tensors}


def test_the_default_finds_the_modules_among_its_attributes_and_in_containers():
    handler = Modules()
    handler.load(None, "cpu")
    modules = [handler.model, *handler.heads, handler.parts["embed"]]
    want = pointers(t for m in modules for t in [*m.parameters(), *m.buffers()])
    assert pointers(handler.weights()) == want
    assert handler.threshold.data_ptr() not in want  # only modules' tensors are declared
    assert any(b is handler.model[1].running_mean for b in handler.weights())  # buffers too


def test_a_handler_without_torch_models_declares_nothing():
    handler = Plain()
    handler.load(None, "cpu")
    assert list(handler.weights()) == []


def test_nothing_is_declared_on_the_cpu_and_a_failing_weights_is_logged_not_raised(caplog):
    handler = Failing()
    handler.load(None, "cpu")
    assert declare_weights(handler, "cpu") == 0  # weights() is not even asked
    assert not caplog.records
    with caplog.at_level(logging.ERROR, logger="omni.python_backend"):
        assert declare_weights(handler, "cuda:0") == 0
    assert "weights() failed" in caplog.text and "handler code" in caplog.text
