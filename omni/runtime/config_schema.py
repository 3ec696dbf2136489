"""Every key of omnid's config file, declared once: its table, type, default, an example and
what it does. The catalog takes its allowed keys from here, and docs/operations.md's
configuration reference is generated from it:

    python -m omni.runtime.config_schema                              # print the reference
    python -m omni.runtime.config_schema --write docs/operations.md   # rewrite it in place
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"
SOURCE = "omni/runtime/config_schema.py"
WRITE_COMMAND = "python -m omni.runtime.config_schema --write docs/operations.md"


@dataclass(frozen=True)
class Key:
    table: str  # "node" (the top level), "gpus", "models" or "models.speculative"
    name: str
    type: str  # as the user writes it: "size", "seconds", "bool", ...
    doc: str  # what it does and when to set it
    example: object  # a value load_config accepts (with `context`)
    default: object = None  # the value the parser takes when the key is left out
    default_text: str = ""  # where no one value says it (with neither: "none")
    context: dict = field(default_factory=dict)  # keys of its table the example needs
    flags: tuple[str, ...] = ()  # omnid's command-line flags that set it too


@dataclass(frozen=True)
class Table:
    name: str
    heading: str
    doc: str


TABLES = (
    Table(
        "node",
        "Top level",
        "Keys at the top of the file. Command-line flags win over the file.",
    ),
    Table(
        "gpus",
        "`[[gpus]]`",
        "One table per GPU that omnid may place instances on. A model's `gpu` must name "
        "one of them; without any, every model runs on the CPU.",
    ),
    Table(
        "models",
        "`[[models]]`",
        "One table per model the node serves, besides the default models and those "
        "loaded with `omnictl load`. The host limits (`memory`, `cpus`, `pids`, `tmp`, "
        "`io`) hold in the isolated sandbox only (see [the security model](#security-model)).",
    ),
    Table(
        "models.speculative",
        "`speculative` (in a `[[models]]` table)",
        'Speculative decoding, written inline: `speculative = {method = "ngram", k = 4}`. '
        "Greedy output is the same as without it; sampled output keeps its distribution.",
    ),
)

KEYS = (
    # --- the top level
    Key(
        "node",
        "listen",
        "host:port",
        "The inference listener (the OpenAI API, `/v1/models`, `/healthz`, `/metrics`), "
        "which has no authentication: open it to the edges only. `$OMNID_HOST` and "
        "`$OMNID_PORT` win over this key.",
        example="10.0.0.5:8081",
        default_text="`127.0.0.1:8081`",
        flags=("--host", "--port"),
    ),
    Key(
        "node",
        "state_dir",
        "absolute path",
        "What outlives omnid: catalog changes made with omnictl (`catalog.json`), the "
        "default models converted on first start, and the disk KV tiers. "
        "`$OMNI_DATA_DIR` applies only where neither the flag nor this key is set.",
        example="/var/lib/omni",
        default_text="`/var/lib/omni` as root, else `$XDG_DATA_HOME/omni`",
        flags=("--data-dir",),
    ),
    Key(
        "node",
        "runtime_dir",
        "absolute path",
        "The admin socket `omnid.sock`, the instances' sockets and directories, and the "
        "records live restore adopts instances by. `$OMNI_RUNTIME_DIR` applies only where "
        "neither the flag nor this key is set.",
        example="/run/omni",
        default_text="`/run/omni` as root, else `$XDG_RUNTIME_DIR/omni`",
        flags=("--runtime-dir",),
    ),
    Key(
        "node",
        "sandbox",
        '"auto", "isolated" or "process"',
        "`isolated` runs each instance in its own cgroup and namespaces (needs root); "
        "`process` runs plain processes, with no limits; `auto` is `isolated` as root, "
        "else `process`. `$OMNI_SANDBOX` wins over this key.",
        example="isolated",
        default_text="`auto`",
        flags=("--sandbox",),
    ),
    Key(
        "node",
        "default_models",
        "bool",
        "Serve the embedded default models (`smollm2-135m-instruct`, "
        "`all-minilm-l6-v2`, `pocketsphinx-en`, `silero-vad`, `langid`) beside the "
        "configured ones.",
        example=False,
        default=True,
        flags=("--no-defaults",),
    ),
    Key(
        "node",
        "swap_timeout",
        "seconds",
        "How long moving an instance's GPU memory to host memory or back may take. A "
        "swap that takes longer restarts the instance, and its waiting requests get 503.",
        example=45,
        default=30,
    ),
    Key(
        "node",
        "request_timeout",
        "seconds",
        "How long a request may wait for its instance (a permit, a swap-in, a start) "
        "before it gets 503.",
        example=120,
        default=60,
    ),
    Key(
        "node",
        "gpu_yield",
        "seconds, 0 to 1",
        "While an instance of a GPU's most wanted models serves, the colder instances of "
        "that GPU together take about one step per this window. 0 turns it off.",
        example=0.05,
        default=0.1,
    ),
    Key(
        "node",
        "dashboard",
        "host:port or port",
        "Serve the read-only dashboard on a TCP listener of its own as well (it is always "
        "on the admin socket, for `omnictl dashboard`). Loopback unless an IP address is "
        "written out; the listener has no authentication.",
        example="127.0.0.1:9182",
    ),
    Key(
        "node",
        "require_limits",
        "list of: memory, cpu, pids, tmp, io, seccomp",
        "Sandbox limits without which no instance starts. omnid still serves its API, "
        "and `omnictl node` names the limits the host does not enforce.",
        example=["memory", "cpu", "pids"],
        default=[],
    ),
    Key(
        "node",
        "live_restore",
        "bool",
        "On SIGTERM, leave sandboxed instances running for the next omnid to adopt. "
        "`--live-restore` or `OMNI_LIVE_RESTORE=1` turn it on too.",
        example=True,
        default=False,
        flags=("--live-restore",),
    ),
    Key(
        "node",
        "orphan_timeout",
        "seconds",
        "How long an instance whose omnid is gone keeps running, waiting for the next "
        "omnid to adopt it, before it ends itself.",
        example=120,
        default=60,
    ),
    Key(
        "node",
        "wheelhouse",
        "path",
        "A directory of wheels from which the `requirements` of python-runtime models are "
        "installed, offline (nothing is fetched from an index).",
        example="/var/lib/omni/wheels",
        default_text="pip's index",
    ),
    Key(
        "node",
        "gpus",
        "array of tables",
        "The GPUs instances may use, each with a memory budget (below).",
        example=[{"index": 0, "budget": "40GiB"}],
    ),
    Key(
        "node",
        "models",
        "array of tables",
        "The models the node serves (below).",
        example=[{"name": "my-llama", "path": "/models/Llama-3.2-1B-Instruct"}],
    ),
    # --- [[gpus]]
    Key(
        "gpus",
        "index",
        "int",
        "The GPU's index (from 0).",
        example=0,
        default_text="required",
    ),
    Key(
        "gpus",
        "budget",
        "size",
        "GPU memory the instances resident on it may hold together, each charged what it "
        "holds: the most since its last swap-in and a margin (its quota at most, and its "
        "whole quota while it loads). Leave room for the driver's own memory.",
        example="40GiB",
        default_text="required",
    ),
    # --- [[models]]
    Key(
        "models",
        "name",
        "string",
        "The name clients ask for: 1 to 64 letters, digits, `.`, `_` or `-`.",
        example="my-llama",
        default_text="required",
    ),
    Key(
        "models",
        "path",
        "path",
        "The Hugging Face checkpoint directory (safetensors, `config.json`, tokenizer). A "
        "sandboxed instance reads it as a uid of its own, so it must be world-readable.",
        example="/models/Llama-3.2-1B-Instruct",
        default_text="required",
    ),
    Key(
        "models",
        "runtime",
        '"omni" or "python"',
        "What runs the model: `omni`, OMNI's own engine (a checkpoint for text generation "
        "or embeddings); `python`, a handler of your own in the model directory or in "
        "`omni/runtimes/`, served over the Open Inference Protocol (`/v2`).",
        example="omni",
        default="omni",
    ),
    Key(
        "models",
        "handler",
        "string",
        'With `runtime = "python"`: the handler class, as `file.py:Class` (a file in the '
        "model directory) or `package.module:Class` (a module on the instance's path).",
        example="handler.py:Model",
        default_text='required with runtime = "python"',
        context={"runtime": "python"},
    ),
    Key(
        "models",
        "requirements",
        "list of string",
        "The handler's own Python packages, pinned (`name==version`, wheels only; "
        "`name==version --no-deps` installs one without its declared dependencies). omnid "
        "builds their environment once and binds it read-only into this model's sandbox.",
        example=["numpy==2.1.3"],
        default_text="none",
        context={"runtime": "python", "handler": "handler.py:Model"},
    ),
    Key(
        "models",
        "max_batch_size",
        "int",
        "How many concurrent requests the instance merges into one `infer()` call of the handler.",
        example=8,
        default_text="the handler's own",
        context={"runtime": "python", "handler": "handler.py:Model"},
    ),
    Key(
        "models",
        "max_queue_delay_ms",
        "milliseconds",
        "How long a request may wait for others to fill its batch.",
        example=5,
        default_text="the handler's own",
        context={"runtime": "python", "handler": "handler.py:Model"},
    ),
    Key(
        "models",
        "infer_timeout",
        "seconds",
        "How long one `infer()` call may take. Past it, its requests get 504 and the "
        "instance is restarted.",
        example=30,
        default=60,
        context={"runtime": "python", "handler": "handler.py:Model"},
    ),
    Key(
        "models",
        "gpu_split",
        "bool",
        "Whether the handler's `gpu_done()` hands the GPU and the request's permit to the "
        "next batch while its CPU work (encoding, resizing) finishes. `false` holds both "
        "until the answer is complete, as a handler without the mark does.",
        example=False,
        default=True,
        context={"runtime": "python", "handler": "handler.py:Model"},
    ),
    Key(
        "models",
        "gpu",
        "int or list of int",
        "The GPU it runs on, or a list of GPUs to split it over (one rank each, rank 0 on "
        "the first). Each needs a `[[gpus]]` entry.",
        example=0,
        default_text="none: the CPU",
        context={"quota": "6GiB"},
    ),
    Key(
        "models",
        "quota",
        "size",
        "GPU memory the instance may hold on each of its GPUs, enforced by libomnicuda; "
        "its KV cache is sized from it. At most the GPU's budget.",
        example="6GiB",
        default_text="required with `gpu`",
        context={"gpu": 0},
    ),
    Key(
        "models",
        "permits",
        "int",
        "Requests the instance works on at once. Four times as many more may wait for a "
        "permit; beyond that, requests get 429.",
        example=32,
        default=64,
    ),
    Key(
        "models",
        "cold",
        "bool",
        "Load it, then move it to host memory until its first request. Only with `gpu`.",
        example=True,
        default=False,
        context={"gpu": 0, "quota": "6GiB"},
    ),
    Key(
        "models",
        "tensor_parallel",
        "int",
        "Ranks (processes, in one sandbox) the model is split over. With `gpu` it must "
        "equal the number of GPUs listed; without, the ranks split it on the CPU.",
        example=2,
        default_text="the number of GPUs in `gpu`, else 1",
    ),
    Key(
        "models",
        "parallel",
        '"tp" or "ep"',
        "How a mixture of experts is split over its ranks: `tp` slices every expert, `ep` "
        "gives each rank whole experts. `ep` needs several ranks.",
        example="ep",
        default="tp",
        context={"tensor_parallel": 2},
    ),
    Key(
        "models",
        "quantization",
        '"fp8"',
        "Quantize a bf16 checkpoint's projections to FP8 (e4m3) at load; an FP8 "
        "checkpoint is read as it is. GPU only.",
        example="fp8",
        default_text="none: as the checkpoint",
        context={"gpu": 0, "quota": "6GiB"},
    ),
    Key(
        "models",
        "kv_cache_dtype",
        '"fp8"',
        "Keep the KV cache in FP8 (e4m3): twice the tokens in the same memory. GPU only.",
        example="fp8",
        default_text="none: the model's dtype",
        context={"gpu": 0, "quota": "6GiB"},
    ),
    Key(
        "models",
        "speculative",
        "inline table",
        "Speculative decoding (below).",
        example={"method": "ngram", "k": 4},
    ),
    Key(
        "models",
        "kv_host_cache",
        "size",
        "A host-memory tier for prefix blocks evicted from the KV cache, inside the "
        "instance's `memory` limit: a later prompt with that prefix copies them back "
        "instead of recomputing them. Not for a model over several ranks.",
        example="8GiB",
    ),
    Key(
        "models",
        "kv_disk_cache",
        "size",
        "A disk tier under the host tier, for the blocks it drops, in the state "
        "directory's `kv-disk/<name>`. Needs `kv_host_cache`. An instance found over it "
        "(checked every 2 s) is restarted.",
        example="64GiB",
        context={"kv_host_cache": "8GiB"},
    ),
    Key(
        "models",
        "role",
        '"prefill" or "decode"',
        "One side of a disaggregated model, with `serves`. Each served model needs a "
        "prefill and a decode entry, of one checkpoint and one `kv_cache_dtype`.",
        example="decode",
        context={"serves": "llama"},
    ),
    Key(
        "models",
        "serves",
        "string",
        "The model name the prefill and decode entries serve together; no entry may "
        "have it as its own name.",
        example="llama",
        context={"role": "decode"},
    ),
    Key(
        "models",
        "memory",
        "size",
        "Host memory limit (cgroup, no swap). An instance killed for going over it is "
        "reported and restarted.",
        example="24GiB",
        default="8GiB",
    ),
    Key(
        "models",
        "cpus",
        "number",
        "CPU quota, in cores (cgroup).",
        example=4,
        default_text="no quota",
    ),
    Key(
        "models",
        "pids",
        "int, at least 8",
        "Processes and threads the instance may have (the pids cgroup, or `RLIMIT_NPROC` "
        "where the host does not delegate it).",
        example=256,
        default=512,
    ),
    Key(
        "models",
        "tmp",
        "size",
        "The size of its private `/tmp`, a tmpfs counted in its memory.",
        example="512MiB",
        default="256MiB",
    ),
    Key(
        "models",
        "io",
        "size",
        "The size of its socket directory, a tmpfs that holds its socket and the KV "
        "handoffs of a disaggregated model: raise it for a prefill side's long prompts.",
        example="1GiB",
        default="256MiB",
    ),
    Key(
        "models",
        "drain",
        "seconds",
        "On unload or restart, how long its requests in flight may take to finish (new "
        "ones get 503) before it is stopped. Set it to a long generation's length.",
        example=120,
        default=60,
    ),
    Key(
        "models",
        "tool_parser",
        '"hermes", "llama3" or "mistral"',
        "How the model writes tool calls, where its chat template does not tell.",
        example="llama3",
        default_text="from its chat template",
    ),
    # --- speculative = {...}
    Key(
        "models.speculative",
        "method",
        '"ngram", "draft", "eagle3" or "mtp"',
        "Where the proposals come from: `ngram` matches the sequence's own prompt and "
        "output (no weights), `draft` runs a smaller model, `eagle3` an EAGLE-3 head, "
        "`mtp` the multi-token-prediction layer of a DeepSeek-V3 checkpoint (no `path`).",
        example="draft",
        default="ngram",
        context={"model": "llama-1b"},
    ),
    Key(
        "models.speculative",
        "k",
        "int, 1 to 16",
        "The most tokens a sequence proposes at a step; each sequence's own k follows "
        "how many it has had accepted.",
        example=8,
        default=4,
    ),
    Key(
        "models.speculative",
        "max_batch",
        "int",
        "A step with more decoding sequences than this does not speculate: large "
        "batches are compute-bound.",
        example=16,
        default=32,
    ),
    Key(
        "models.speculative",
        "ngram_max",
        "int",
        "`ngram`: the longest run of the sequence's last tokens matched.",
        example=3,
        default=4,
    ),
    Key(
        "models.speculative",
        "ngram_min",
        "int",
        "`ngram`: the shortest.",
        example=2,
        default=1,
    ),
    Key(
        "models.speculative",
        "path",
        "absolute path",
        "`draft`: a smaller causal LM with the model's tokenizer; `eagle3`: an EAGLE-3 "
        "head's checkpoint. Bound read-only into the instance's sandbox.",
        example="/models/Llama-3.2-1B-Instruct",
        context={"method": "draft"},
    ),
    Key(
        "models.speculative",
        "model",
        "string",
        "`draft`: the draft's `[[models]]` entry, by name, instead of `path`.",
        example="llama-1b",
        context={"method": "draft"},
    ),
)


def keys(table: str) -> set[str]:
    """The keys `table` may hold ("node", "gpus", "models", "models.speculative")."""
    if table not in {t.name for t in TABLES}:
        raise KeyError(table)
    return {k.name for k in KEYS if k.table == table}


def toml_value(value: object) -> str:
    """`value` as TOML writes it (the types the schema's examples use)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for {value!r}")


def _default(key: Key) -> str:
    if key.default_text:
        return key.default_text
    return "none" if key.default is None else f"`{toml_value(key.default)}`"


def _row(key: Key) -> str:
    example = f"`{key.name} = {toml_value(key.example)}`"
    doc = key.doc
    if key.flags:
        doc += " Command line: " + ", ".join(f"`{f}`" for f in key.flags) + "."
    return f"| {example} | {key.type} | {_default(key)} | {doc} |"


def reference() -> str:
    """The configuration reference, in Markdown, between its two marker lines."""
    lines = [START, f"<!-- Generated by `{WRITE_COMMAND}` from {SOURCE}: edit it there. -->"]
    for table in TABLES:
        lines += ["", f"### {table.heading}", "", table.doc, ""]
        lines += [
            "| Key and example | Type | Default | What it does |",
            "| --- | --- | --- | --- |",
        ]
        lines += [_row(k) for k in KEYS if k.table == table.name]
    return "\n".join([*lines, "", END])


def rewrite(text: str) -> str:
    """`text` with the reference between its markers replaced by the current one."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {START} ... {END} section")
    return text[:start] + reference() + text[end + len(END) :]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print omnid's configuration reference.")
    parser.add_argument("--write", type=Path, help="rewrite the reference in this Markdown file")
    args = parser.parse_args(argv)
    if args.write is None:
        sys.stdout.write(reference() + "\n")
        return
    args.write.write_text(rewrite(args.write.read_text()))


if __name__ == "__main__":
    main()
