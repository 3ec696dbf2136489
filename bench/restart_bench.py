"""Live restore (issue 49): omnid restarted under steady load, against a cold start.

Four resident models (copies of one random Llama checkpoint) behind the edge, with
`live_restore = true`. Client threads send short completions through the edge for the
whole run, retrying a 503 that carries Retry-After until a per-request deadline; every
request ends ok, retried-then-ok or lost. Under that load:

1. cold start: omnid's spawn to every model answering through the edge;
2. five restarts (SIGTERM, as `systemctl restart`, and SIGKILL, a crash), each after a
   few seconds of steady serving: the signal to the first request served again and to
   every model served again, requests lost, and whether every instance kept its pid
   (adopted, not reloaded) and its restart count;
3. a cold restart of the same models for comparison: drain, SIGTERM, a fresh omnid.

Prints a table and writes bench/results/restart-<device>.json (`--small`:
restart-<device>-small.json) with every request's raw figures. Needs root (sandboxed
instances). `--small`: a tiny 2-layer model on the CPU, to check the harness anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import psutil  # noqa: E402

from bench.engine_bench import device_tag, write_checkpoint  # noqa: E402
from bench.overcommit_bench import hf_config  # noqa: E402
from bench.results_io import write_result  # noqa: E402
from omni.isolation import hostfs  # noqa: E402
from omni.paths import admin_socket  # noqa: E402

RESTARTS = ("term", "kill", "term", "kill", "term")  # 3 x systemctl restart, 2 x a crash
SIGNALS = {"term": signal.SIGTERM, "kill": signal.SIGKILL}
T0 = time.monotonic()  # every time in the results is seconds since the bench started


def now() -> float:
    return round(time.monotonic() - T0, 4)


# ---------------------------------------------------------------- the model on disk


def model_config(small: bool) -> dict:
    """A ~1.1B-parameter Llama shape (2.2 GiB in bf16), or a tiny 2-layer one; no EOS, so
    every request runs to its max_tokens."""
    if small:
        cfg = hf_config("llama", 128, 2, 4, 2, 256, tied=False)
        cfg.update(vocab_size=512, max_position_embeddings=512)
    else:
        cfg = hf_config("llama", 2048, 16, 32, 8, 8192, tied=False)
    return cfg


def write_model(root: Path, small: bool) -> tuple[Path, dict]:
    """engine_bench's random checkpoint under `root`, readable by the sandboxes' uids
    (they read it as 'other'); the four models all name this one directory."""
    cfg = model_config(small)
    path, took = write_checkpoint(root, cfg, shards=1, seed=0)
    for p in (root, path):
        p.chmod(0o755)
    size = sum(f.stat().st_size for f in path.iterdir()) / 2**30
    print(f"checkpoint {path} ({size:.2f} GiB, written in {took:.1f}s)")
    return path, cfg


def omnid_config(model: Path, names: list[str], args) -> str:
    """live_restore on; on the GPU each model has its quota on GPU 0 under a budget of
    exactly their sum (all four resident, a small share of the card); none on the CPU."""
    lines = ["live_restore = true", f"orphan_timeout = {args.orphan_timeout}", ""]
    if not args.small:
        budget = f"{args.quota_gib * len(names)}GiB"
        lines += ["[[gpus]]", "index = 0", f'budget = "{budget}"', ""]
    for name in names:
        lines += ["[[models]]", f'name = "{name}"', f"path = {json.dumps(str(model))}"]
        if not args.small:
            lines += ['runtime = "omni"', "gpu = 0", f'quota = "{args.quota_gib}GiB"']
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    """The predicate's first truthy value, polled; a RuntimeError naming `what` after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval_s)
    raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}")


class Omnid:
    """omnid's successive processes on one port, runtime dir and config, as systemd runs
    one unit: `spawn` starts the next once the last has exited. Their logs append to one
    file."""

    def __init__(self, workdir: Path, config: str):
        self.config = workdir / "omnid.toml"
        self.config.write_text(config)
        self.data = workdir / "data"
        self.port = free_port()
        self.runtime = Path(tempfile.mkdtemp(prefix="omni-rb-", dir="/tmp"))  # short: sockets
        self.log = workdir / "omnid.log"
        self.proc: subprocess.Popen | None = None
        self.spawns = 0

    def spawn(self) -> float:
        """Start an omnid; returns when (bench time) it was spawned."""
        argv = [sys.executable, "-m", "omni.runtime.omnid", "--config", str(self.config)]
        argv += ["--no-defaults", "--port", str(self.port), "--runtime-dir", str(self.runtime)]
        argv += ["--data-dir", str(self.data), "--sandbox", "isolated"]
        env = {**os.environ, "OMNI_DATA_DIR": str(self.data)}
        at = now()
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(
                argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        self.spawns += 1
        return at

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, how: str, timeout_s: float = 120) -> float:
        """Signal the running omnid and wait for its exit; returns when it exited."""
        self.proc.send_signal(SIGNALS[how])
        self.proc.wait(timeout=timeout_s)
        return now()

    def admin(self) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=str(admin_socket(self.runtime)))
        return httpx.Client(transport=transport, base_url="http://omnid", timeout=30)

    def instances(self) -> dict[str, dict]:
        with self.admin() as c:
            return {i["name"]: i for i in c.get("/v1/instances").json()["instances"]}

    def ready(self, names: list[str]) -> dict[str, dict] | None:
        """Every instance ready (omnid's view), or None; raises if omnid has exited or an
        instance failed for good."""
        if not self.alive():
            raise RuntimeError(f"omnid exited ({self.proc.returncode}):\n{self.tail()}")
        try:
            inst = self.instances()
        except (httpx.TransportError, ValueError, KeyError):
            return None
        if failed := [f"{n}: {i['failure']}" for n, i in inst.items() if i.get("failure")]:
            raise RuntimeError("instances failed:\n" + "\n".join(failed))
        return inst if all(inst.get(n, {}).get("state") == "ready" for n in names) else None

    def drain(self, timeout_s: float) -> None:
        """omnictl drain: in-flight requests finish, then every instance stops (the way to
        end instances that outlive omnid)."""
        pids = [i["pid"] for i in self.instances().values() if i.get("pid")]
        with self.admin() as c:
            c.post("/v1/node/drain").raise_for_status()
        wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), timeout_s, "a drain", 0.1)

    def tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""


def start_edge(workdir: Path, upstream_port: int) -> tuple[subprocess.Popen, int]:
    """The edge in front of omnid (no dashboard listener); returns once it accepts."""
    port = free_port()
    argv = [sys.executable, "-m", "edge.server", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--upstream", f"http://127.0.0.1:{upstream_port}", "--dashboard", "off"]
    with (workdir / "edge.log").open("a") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)

    def accepts() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"edge exited:\n{(workdir / 'edge.log').read_text()[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return True
        return False

    wait_for(accepts, 60, "the edge's port")
    return proc, port


# ---------------------------------------------------------------- the load


@dataclass
class Request:
    """One client request as the client saw it; times in bench seconds. `last_try` is
    when its last attempt was sent: a request served with last_try after an omnid's exit
    was served by the next one."""

    model: str
    stream: bool
    start: float
    end: float = 0.0
    last_try: float = 0.0
    attempts: int = 0
    outcome: str = "lost"  # ok | retried | lost
    detail: str = ""  # what a lost request got; the statuses a retried one waited through


class Lost(Exception):
    """An answer that is not a served request and not a 503 to retry."""


class Retry(Exception):
    """A 503 with Retry-After: the edge says come back in `after` seconds."""

    def __init__(self, after: float):
        self.after = after


def read_answer(r: httpx.Response, stream: bool) -> None:
    """Raise Retry for a 503 with Retry-After, Lost for anything but a whole answer."""
    if r.status_code == 503 and "retry-after" in r.headers:
        r.read()
        raise Retry(float(r.headers["retry-after"]))
    if r.status_code != 200:
        r.read()
        raise Lost(f"http {r.status_code}: {r.text[:120]}")
    if not stream:
        if not r.read() or "choices" not in r.json():
            raise Lost("no choices")
        return
    done = False
    for line in r.iter_lines():
        if line.startswith("data:") and '"error"' in line:
            raise Lost(f"error event: {line[:120]}")
        done = done or line.strip() == "data: [DONE]"
    if not done:
        raise Lost("stream ended without [DONE]")


def send(client: httpx.Client, req: Request, body: dict, deadline_s: float) -> Request:
    """One request to its end: 503 + Retry-After is waited out and retried until the
    deadline; anything else that is not a whole answer loses it (a timeout, a reset, a
    5xx without Retry-After, a stream cut short)."""
    deadline = time.monotonic() + deadline_s
    waited: list[str] = []
    while True:
        req.attempts += 1
        req.last_try = now()
        left = deadline - time.monotonic()
        try:
            with client.stream("POST", "/v1/completions", json=body, timeout=left) as r:
                read_answer(r, req.stream)
            req.outcome = "ok" if req.attempts == 1 else "retried"
            req.detail = ",".join(waited)
            break
        except Retry as retry:
            waited.append("503")
            if time.monotonic() + retry.after >= deadline:
                req.detail = f"deadline after {req.attempts} attempts"
                break
            time.sleep(retry.after)
        except (Lost, ValueError) as exc:  # ValueError: a body that is not JSON
            req.detail = str(exc)
            break
        except httpx.HTTPError as exc:
            req.detail = f"{type(exc).__name__}: {exc}"[:160]
            break
    req.end = now()
    return req


class Load:
    """`clients` threads, each sending one request at a time through the edge, round-robin
    over the models, every fourth streamed, for as long as the bench runs."""

    def __init__(self, edge_port: int, models: list[str], vocab: int, args):
        self.url, self.models, self.args = f"http://127.0.0.1:{edge_port}", models, args
        self.prompt = " ".join(f"t{1 + i % (vocab - 1)}" for i in range(args.prompt_words))
        self.requests: list[Request] = []
        self.turn = itertools.count()
        self.stopped = threading.Event()
        self.threads = [
            threading.Thread(target=self._client, daemon=True) for _ in range(args.clients)
        ]
        for t in self.threads:
            t.start()

    def _client(self) -> None:
        with httpx.Client(base_url=self.url) as client:
            while not self.stopped.is_set():
                n = next(self.turn)
                model, stream = self.models[n % len(self.models)], n % 4 == 3
                body = {"model": model, "prompt": self.prompt, "stream": stream}
                body |= {"max_tokens": self.args.max_tokens, "temperature": 0}
                req = Request(model, stream, start=now())
                self.requests.append(send(client, req, body, self.args.deadline))

    def stop(self) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(timeout=self.args.deadline + 10)

    def served_after(self, t: float) -> dict[str, float]:
        """Per model, when the first request whose last attempt was sent after `t` was
        served (ends, in bench seconds)."""
        first: dict[str, float] = {}
        for r in list(self.requests):
            if r.outcome != "lost" and r.last_try >= t and r.end < first.get(r.model, 1e18):
                first[r.model] = r.end
        return first


# ---------------------------------------------------------------- the run's phases


def instance_view(inst: dict[str, dict]) -> dict[str, dict]:
    """What the bench keeps of omnid's /v1/instances: pid, restarts, state, residency."""
    keys = ("pid", "restarts", "state", "residency")
    return {n: {k: i.get(k) for k in keys} for n, i in sorted(inst.items())}


def serving(load: Load, omnid: Omnid, since: float, names: list[str], timeout_s: float) -> dict:
    """After an omnid's spawn: when the first and the last model served again (requests
    sent after `since`, when no other omnid was up), and omnid's view once all are ready.
    Fails at once if omnid exits or gives up on an instance."""

    def done():
        inst, served = omnid.ready(names), load.served_after(since)
        return inst and len(served) == len(names) and (inst, served)

    inst, served = wait_for(done, timeout_s, "every model ready and served", 0.2)
    return {
        "first_served": min(served.values()),
        "all_served": max(served.values()),
        "served": served,
        "instances": instance_view(inst),
        "omnid_starts": omnid.spawns,
    }


# Each phase fills in its dict as it goes, so one that never serves again (it raises)
# still shows how far it got. "begin" is what its times count from.


def cold_start(load: Load, omnid: Omnid, names: list[str], args, phase: dict) -> None:
    """A fresh omnid (nothing to adopt) to every model served through the edge."""
    phase["spawned"] = phase["begin"] = omnid.spawn()
    phase |= serving(load, omnid, phase["spawned"], names, args.ready_timeout)


def restart(load: Load, omnid: Omnid, how: str, names: list[str], args, phase: dict) -> None:
    """Signal omnid, start the next once it has exited (as systemd would), and see how
    soon the edge serves again and whether the instances were adopted as they ran."""
    phase |= {"n": omnid.spawns, "signal": how, "before": instance_view(omnid.instances())}
    phase["signalled"] = phase["begin"] = now()
    phase["exited"] = omnid.stop(how)
    phase["exit_code"] = omnid.proc.returncode
    phase["spawned"] = omnid.spawn()
    phase |= serving(load, omnid, phase["exited"], names, args.ready_timeout)
    before, after = phase["before"], phase["instances"]
    phase["adopted"] = all(after[n]["pid"] == before[n]["pid"] for n in names)
    phase["reloads"] = sum(after[n]["restarts"] - before[n]["restarts"] for n in names)


def cold_restart(load: Load, omnid: Omnid, names: list[str], args, phase: dict) -> None:
    """The comparison: the same models stopped (drain, SIGTERM) and started by a fresh
    omnid, under the same load."""
    phase["before"] = instance_view(omnid.instances())
    phase["drained"] = phase["begin"] = now()
    omnid.drain(args.ready_timeout)
    phase["exited"] = omnid.stop("term")
    phase["spawned"] = omnid.spawn()
    phase |= serving(load, omnid, phase["spawned"], names, args.ready_timeout)
    phase["reloaded"] = all(
        phase["instances"][n]["pid"] != phase["before"][n]["pid"] for n in names
    )


def timings(phase: dict) -> None:
    """Seconds from the phase's begin (and from omnid's spawn) to served again."""
    if "all_served" in phase:
        phase["to_first_served_s"] = round(phase["first_served"] - phase["begin"], 3)
        phase["to_all_served_s"] = round(phase["all_served"] - phase["begin"], 3)
        phase["spawn_to_all_served_s"] = round(phase["all_served"] - phase["spawned"], 3)


def outcomes(requests: list[Request], begin: float, end: float) -> dict:
    """Requests that ended in [begin, end): counted by outcome, the lost ones listed (a
    request cut by a restart ends right after it, so it counts there)."""
    within = [r for r in requests if begin <= r.end < end]
    counts = {k: sum(r.outcome == k for r in within) for k in ("ok", "retried", "lost")}
    lost = [asdict(r) for r in within if r.outcome == "lost"]
    return {**counts, "total": len(within), "lost_requests": lost}


def attribute(requests: list[Request], phases: list[dict], end: float) -> None:
    """Each phase's requests: from its begin (the first from the bench's start) to the
    next's."""
    begins = [0.0] + [p.get("begin", end) for p in phases[1:]]
    for phase, begin, until in zip(phases, begins, [*begins[1:], end], strict=True):
        phase["requests"] = outcomes(requests, begin, until)


# ---------------------------------------------------------------- report


def title(phase: dict) -> str:
    if phase["phase"] == "restart":
        return f"restart {phase['n']} {phase['signal']}"
    return phase["phase"]


def adopted(phase: dict) -> str:
    """A restart's instances kept their pids and none restarted; the cold restart's did not."""
    if phase["phase"] == "restart":
        return "yes" if phase["adopted"] and phase["reloads"] == 0 else "NO"
    if phase["phase"] == "cold restart":
        return "no" if phase["reloaded"] else "?"
    return "-"


def print_table(res: dict) -> None:
    """One row a phase: seconds to the first and to every model served again from its
    begin (the cold start's spawn, a restart's signal, the cold restart's drain) and from
    omnid's spawn; whether the instances were adopted; its requests by outcome."""
    head = ("phase", "1st served", "all served", "from spawn", "adopted", "ok", "retried", "lost")
    print("\n{:<16}{:>11}{:>11}{:>11}{:>8}{:>6}{:>8}{:>5}".format(*head))
    for p in res["phases"]:
        r = p["requests"]
        label = title(p)
        if "error" in p:
            print(f"{label:<16} failed: {p['error'][:70]}")
            continue
        times = (p["to_first_served_s"], p["to_all_served_s"], p["spawn_to_all_served_s"])
        print(
            "{:<16}{:>11.2f}{:>11.2f}{:>11.2f}".format(label, *times)
            + f"{adopted(p):>8}{r['ok']:>6}{r['retried']:>8}{r['lost']:>5}"
        )
    s = res["summary"]
    print(
        f"\nrestarts: {s['lost']} of {s['requests']} requests lost (goal 0), "
        f"{s['adopted']} of {s['restarts']} adopted; every model served again "
        f"{s['to_all_served_s_mean']} s after the signal (mean), {s['to_all_served_s_max']} "
        f"s at worst; cold restart: {s['cold_from_spawn_s']} s from omnid's spawn"
    )


def summary(phases: list[dict]) -> dict:
    restarts = [p for p in phases if p["phase"] == "restart"]
    done = [p["to_all_served_s"] for p in restarts if "to_all_served_s" in p]
    cold = [p.get("spawn_to_all_served_s") for p in phases if p["phase"] == "cold restart"]
    return {
        "restarts": len(restarts),
        "failed": sum("error" in p for p in phases),
        "adopted": sum(p.get("adopted", False) and p.get("reloads") == 0 for p in restarts),
        "lost": sum(p["requests"]["lost"] for p in restarts),
        "requests": sum(p["requests"]["total"] for p in restarts),
        "to_all_served_s": done,
        "to_all_served_s_max": max(done, default=None),
        "to_all_served_s_mean": round(sum(done) / len(done), 3) if done else None,
        "cold_from_spawn_s": cold[0] if cold else None,
    }


# ---------------------------------------------------------------- main


def remember(state: dict, phase: dict) -> None:
    """The instances' pids, for cleanup to end should the run fail with them orphaned."""
    for view in (phase.get("before", {}), phase.get("instances", {})):
        state["pids"] |= {i["pid"] for i in view.values() if i["pid"]}


def run(args, workdir: Path, state: dict) -> dict:
    """The whole measurement; `state` holds what cleanup needs if it fails midway. A phase
    that never serves again ends the run: the figures so far are kept, with its error."""
    model, cfg = write_model(workdir / "ckpt", args.small)
    names = [f"m{i}" for i in range(args.models)]
    omnid = state["omnid"] = Omnid(workdir, omnid_config(model, names, args))
    edge, edge_port = start_edge(workdir, omnid.port)
    state["edge"] = edge
    load = state["load"] = Load(edge_port, names, cfg["vocab_size"], args)
    plan = [("cold start", cold_start, ())]
    plan += [("restart", restart, (how,)) for how in RESTARTS[: args.restarts]]
    plan.append(("cold restart", cold_restart, ()))
    phases: list[dict] = []
    print(f"{len(names)} models under {args.clients} clients")
    for label, step, extra in plan:
        phases.append(phase := {"phase": label})
        try:
            step(load, omnid, *extra, names, args, phase)
        except (RuntimeError, httpx.HTTPError, subprocess.TimeoutExpired) as exc:
            phase["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{label} failed: {exc}")
            break
        finally:
            remember(state, phase)
        timings(phase)
        print(f"{title(phase)}: every model served {phase['to_all_served_s']:.2f}s after it began")
        time.sleep(args.settle)  # steady serving before the next
    load.stop()
    attribute(load.requests, phases, now())
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        | {"model": cfg, "one_checkpoint_for": names},
        "phases": phases,
        "summary": summary(phases),
        "requests": [asdict(r) for r in load.requests],
    }


def cleanup(state: dict, workdir: Path) -> None:
    """Stop the load, drain through the last omnid (its instances, adopted or not, end
    with it), stop omnid and the edge, end any instance left, remove the temp dirs."""
    if load := state.get("load"):
        load.stop()
    omnid: Omnid | None = state.get("omnid")
    if omnid is not None and omnid.alive():
        with contextlib.suppress(Exception):
            state["pids"] |= {i["pid"] for i in omnid.instances().values() if i.get("pid")}
            omnid.drain(120)
        with contextlib.suppress(Exception):
            omnid.stop("term", 60)
        if omnid.alive():
            omnid.proc.kill()
    for pid in state["pids"]:  # a failed run's leftovers (a drained run has none)
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(pid, signal.SIGKILL)
    if (edge := state.get("edge")) is not None:
        edge.terminate()
        edge.wait(30)
    if omnid is not None:
        hostfs.remove_tree(omnid.runtime)
    shutil.rmtree(workdir, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny model on the CPU")
    ap.add_argument("--models", type=int, default=4)
    ap.add_argument("--restarts", type=int, default=len(RESTARTS), choices=range(1, 6))
    ap.add_argument("--clients", type=int, default=8, help="client threads")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=16)
    ap.add_argument("--deadline", type=float, default=30.0, help="seconds a request may take")
    ap.add_argument("--settle", type=float, default=5.0, help="steady serving between restarts")
    ap.add_argument("--quota-gib", type=int, default=6, help="GPU memory per model")
    ap.add_argument("--orphan-timeout", type=float, default=120.0)
    ap.add_argument("--ready-timeout", type=float, default=150.0, help="a phase, at most")
    ap.add_argument("--logs", type=Path, help="copy omnid's and the edge's logs here")
    ap.add_argument("--name", help="results file name (default restart-<device>[-small])")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    if os.geteuid() != 0:
        raise SystemExit("sandboxed instances need root")
    name = args.name or f"restart-{device_tag()}" + ("-small" if args.small else "")
    workdir = Path(tempfile.mkdtemp(prefix="omni-restart-bench-", dir="/tmp"))
    workdir.chmod(0o755)  # the checkpoint under it is read by the sandboxes' uids
    state: dict = {"pids": set()}
    started = time.monotonic()
    try:
        res = run(args, workdir, state)
        res["wall_s"] = round(time.monotonic() - started, 1)
        path = write_result(name, res)
        print_table(res)
        print("wrote", path)
        failed = res["summary"]["failed"]
    except BaseException:
        if (omnid := state.get("omnid")) is not None:
            print(f"omnid's log:\n{omnid.tail()}", file=sys.stderr)
        raise
    finally:
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            for f in ("omnid.log", "edge.log"):
                with contextlib.suppress(OSError):
                    shutil.copy(workdir / f, args.logs / f"restart-{f}")
        cleanup(state, workdir)
    print(f"took {time.monotonic() - started:.0f}s")
    if failed:
        raise SystemExit(f"{failed} phase(s) never served again: see 'error' in the results")


if __name__ == "__main__":
    main()
