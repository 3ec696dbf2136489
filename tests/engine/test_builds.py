"""The Triton build log: counts every build, logs those after the warm-up, and leaves
hooks that someone else set alone."""

from __future__ import annotations

import logging

import triton

from omni.engine.kernels import builds
from omni.engine.kernels.builds import BuildLog


class Fn:
    name = "_rope_cache_kernel"


def build(log: BuildLog, key: str, variant: str, constants: dict | None = None) -> None:
    """As Triton calls its hooks around one build; False lets it build."""
    compile = {"constants": constants or {}}
    assert log.before(key=key, repr=variant, fn=Fn(), compile=compile) is False
    assert log.after(key=key, repr=variant, fn=Fn(), compile=compile) is False


def test_counts_every_build_and_warns_only_once_warm(caplog):
    log = BuildLog(keep=2)
    with caplog.at_level(logging.WARNING, logger=builds.__name__):
        build(log, "a", "_rope_cache_kernel[...](pos_ptr: *i64:16)")
        assert caplog.text == ""  # the warm-up's builds are expected
        log.warm = True
        build(log, "b", "_rope_cache_kernel[...](pos_ptr: *i64)")
    assert "waited" in caplog.text and "(pos_ptr: *i64)" in caplog.text
    build(log, "c", "third")
    assert log.count == 3
    kept = log.since(0)  # only the last two are kept
    assert [b.seq for b in kept] == [2, 3]
    assert [b.kernel for b in kept] == ["_rope_cache_kernel"] * 2
    assert log.since(2)[0].variant == "third"


def test_a_variant_names_its_constexpr_values():
    """Triton's repr lists argument types only; a constexpr that follows the step's size
    (a program count, say) shows in the constants."""
    log = BuildLog()
    build(log, "a", "_linear_tma_kernel[...](M: i32)", {(9,): 128})
    assert log.since(0)[0].variant == "_linear_tma_kernel[...](M: i32) constants={(9,): 128}"


def test_install_leaves_someone_elses_hooks(monkeypatch):
    knobs = triton.knobs.runtime

    def theirs(**kw):
        return False

    monkeypatch.setattr(knobs, "jit_cache_hook", theirs)  # restored after the test
    monkeypatch.setattr(knobs, "jit_post_compile_hook", None)
    assert builds.install() is False
    assert knobs.jit_cache_hook is theirs

    monkeypatch.setattr(knobs, "jit_cache_hook", None)
    assert builds.install() is True
    assert knobs.jit_cache_hook == builds.BUILDS.before
    assert builds.install() is True  # again: already ours
