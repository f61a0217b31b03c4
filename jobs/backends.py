"""How the CLI reaches jobs: straight through the store (default) or through the REST API (`--api URL`).

Both clients speak the REST API's job object, so the CLI prints the same thing either way.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jobs import store
from jobs.errors import IdempotencyConflict, InvalidJob, JobNotFound, StoreUnavailable
from jobs.outputs import iter_errors, iter_results, job_public
from jobs.runtime import Runtime
from jobs.submission import submit_batch


class StoreBackend:
    """Direct access to the store (embedded SQLite by default)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        runtime.ensure_store()

    def submit(self, path: Path, *, model: str, completion_window: str) -> dict[str, Any]:
        job = submit_batch(self.runtime, path.read_bytes(), model=model, filename=path.name,
                           completion_window=completion_window)
        return self.get(job.id)

    def get(self, job_id: str) -> dict[str, Any]:
        with self.runtime.session() as session:
            return job_public(session=session, job=store.get_job(session=session, job_id=job_id))

    def list(self) -> list[dict[str, Any]]:
        with self.runtime.session() as session:
            return [job_public(session=session, job=job) for job in store.list_jobs(session=session)]

    def cancel(self, job_id: str) -> dict[str, Any]:
        with self.runtime.session() as session:
            job = self.runtime.lifecycle.cancel(session, job_id)
            session.commit()
            return job_public(session=session, job=job)

    def results(self, job_id: str) -> Iterator[str]:
        with self.runtime.session() as session:
            job = store.get_job(session=session, job_id=job_id)
        yield from iter_results(sessions=self.runtime.session, job=job)

    def errors(self, job_id: str) -> Iterator[str]:
        with self.runtime.session() as session:
            job = store.get_job(session=session, job_id=job_id)
        yield from iter_errors(sessions=self.runtime.session, job=job)


class ApiBackend:
    """The REST API with a bearer key."""

    def __init__(self, url: str, key: str | None) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=60)

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise StoreUnavailable(f"cannot reach the API at {self.http.base_url}: {e}") from e
        if response.status_code == 404:
            raise JobNotFound(path.split("/")[3] if path.count("/") >= 3 else path)
        if response.status_code >= 400:
            message = response.json().get("error", {}).get("message") if response.headers.get(
                "content-type", "").startswith("application/json") else response.text
            raise api_error(response.status_code, message)
        return response

    def submit(self, path: Path, *, model: str, completion_window: str) -> dict[str, Any]:
        with path.open("rb") as file:
            response = self._call("POST", "/v1/batches", files={"file": (path.name, file)},
                                  data={"model": model, "completion_window": completion_window})
        return dict(response.json())

    def get(self, job_id: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/batches/{job_id}").json())

    def list(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/batches").json()["data"])

    def cancel(self, job_id: str) -> dict[str, Any]:
        return dict(self._call("POST", f"/v1/batches/{job_id}/cancel").json())

    def results(self, job_id: str) -> Iterator[str]:
        yield from self._call("GET", f"/v1/batches/{job_id}/results").text.splitlines(keepends=True)

    def errors(self, job_id: str) -> Iterator[str]:
        yield from self._call("GET", f"/v1/batches/{job_id}/errors").text.splitlines(keepends=True)


def api_error(status: int, message: str) -> Exception:
    """The error of ours that an API error answer means (so the CLI exits with the code docs/reference/errors.md lists)."""
    if status == 409:
        return IdempotencyConflict(f"API answered 409: {message}")
    if status == 429:
        return StoreUnavailable(f"API answered 429: {message}; the API is busy with other submissions: retry shortly")
    if status in (400, 401, 413, 422):  # the request itself is refused: fix it (413: the file is too large)
        return InvalidJob(f"API answered {status}: {message}")
    return StoreUnavailable(f"API answered {status}: {message}")
