"""Async requests: accepted at once (202 and an id), run when the fair queue allows,
their answers kept for the caller to fetch. Batch-style traffic queues at the edge
instead of holding a connection open per request, which smooths its spikes.

Answers are kept in memory for KEEP_S after they finish, and at most MAX_JOBS
requests are held: past that, new async requests get 429. Only the tenant that
sent a request can fetch its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field

import aiohttp

from omni.api.errors import ApiError
from omni.api.proxy import upstream_failed

KEEP_S = 3600.0
MAX_JOBS = 10_000


@dataclass(eq=False)
class Job:
    id: str
    tenant: str
    created: float = field(default_factory=time.time)
    status: str = "queued"  # queued, running, done
    finished: float | None = None  # monotonic
    result: tuple[int, str, bytes] | None = None  # status, content type, body

    def finish(self, status: int, content_type: str, body: bytes) -> None:
        self.status, self.finished = "done", time.monotonic()
        self.result = (status, content_type, body)

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "object": "async.request",
            "status": self.status,
            "created": int(self.created),
            "url": f"/v1/async/{self.id}",
        }


class AsyncJobs:
    def __init__(self, keep_s: float = KEEP_S, max_jobs: int = MAX_JOBS):
        self.keep_s, self.max_jobs = keep_s, max_jobs
        self.jobs: dict[str, Job] = {}
        self._tasks: set[asyncio.Task] = set()

    def create(self, tenant: str) -> Job:
        self._expire()
        if len(self.jobs) >= self.max_jobs:
            raise ApiError(
                429,
                "Too many async requests are held; retry later.",
                code="overloaded",
                retry_after=10,
            )
        job = Job(f"async-{secrets.token_hex(12)}", tenant)
        self.jobs[job.id] = job
        return job

    def start(self, job: Job, work: Coroutine) -> None:
        task = asyncio.create_task(work, name=job.id)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def get(self, job_id: str, tenant: str) -> Job | None:
        """The job, if it exists and is this tenant's (another's looks like no job)."""
        self._expire()
        job = self.jobs.get(job_id)
        return job if job is not None and job.tenant == tenant else None

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _expire(self) -> None:
        now = time.monotonic()
        for job_id in [
            j.id for j in self.jobs.values() if j.finished and now - j.finished > self.keep_s
        ]:
            del self.jobs[job_id]


async def fetch(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]
) -> tuple[int, str, bytes]:
    """POST and read the whole answer; UpstreamFailed when the node fails to give one."""
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            return resp.status, resp.content_type, await resp.read()
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise upstream_failed(f"omnid failed to answer: {exc}; retry shortly.", 1) from None
