"""The whole suite captures models into one throwaway capture cache, never the user's; inductor
compiles in-process; each of several xdist workers runs torch on one thread; and ``one_thread``,
for test modules of tiny tensors run without xdist."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

_OWN = "_HYDRO_TEST_CACHE_OWNER"


def pytest_configure(config: object) -> None:
    # inductor compiles in the test's own process: its default pool of compile workers (one
    # process per core, each importing torch) would compete with the other xdist worker
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        # one xdist worker per core: each on one thread (and so the processes it starts), or
        # OpenMP threads spin on the core the other worker holds (a float64 depthwise conv of
        # the timm tests took 18 s on two threads so, against 0.05 s on one)
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
    # xdist workers inherit the controller's environment: they share its folder (writes of one
    # key by two workers are atomic replaces of whole files)
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(_OWN):
        return
    os.environ["HYDRO_CACHE_DIR"] = tempfile.mkdtemp(prefix="hydro-test-cache-")
    os.environ[_OWN] = str(os.getpid())


def pytest_unconfigure(config: object) -> None:
    if os.environ.get(_OWN) == str(os.getpid()):
        shutil.rmtree(os.environ["HYDRO_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch on one thread for the test: its tensors are tiny, and on a busy 2-core machine
    OpenMP threads waiting for each other cost more than they bring. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")`` (or a directory's autouse fixture)."""
    import torch  # here, not at the top: conftest is read before any test asks for torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def postgres() -> Iterator[object]:
    """A PostgreSQL server of this test process's own on 127.0.0.1 (:mod:`tests.pg_server`),
    stopped at the end of the session; each xdist worker that asks starts its own. Skips only
    where the server binaries are not installed (``.ci/run`` installs them)."""
    from tests import pg_server
    from tests.waiting import patience

    why = pg_server.missing()
    if why:
        pytest.skip(why)
    server = pg_server.Server(timeout=patience(60))
    try:
        yield server.start()
    finally:
        server.stop()
