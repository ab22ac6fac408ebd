"""The whole suite captures models into one throwaway capture cache, never the user's."""

from __future__ import annotations

import os
import shutil
import tempfile

_OWN = "_HYDRO_TEST_CACHE_OWNER"


def pytest_configure(config: object) -> None:
    # xdist workers inherit the controller's environment: they share its folder (writes of one
    # key by two workers are atomic replaces of whole files)
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(_OWN):
        return
    os.environ["HYDRO_CACHE_DIR"] = tempfile.mkdtemp(prefix="hydro-test-cache-")
    os.environ[_OWN] = str(os.getpid())


def pytest_unconfigure(config: object) -> None:
    if os.environ.get(_OWN) == str(os.getpid()):
        shutil.rmtree(os.environ["HYDRO_CACHE_DIR"], ignore_errors=True)
