"""Shared test setup: a cache dir the tests own, so sdists, trees and ccache survive reruns."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

TEST_CMAKE_ARGS = "'-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG' '-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG'"
TEST_CACHE = Path(os.environ.get("DFBUILD_TEST_CACHE", Path.home() / ".cache" / "dfbuild-tests"))


@pytest.fixture(scope="session", autouse=True)
def _ctrl_c_reaches_the_tests_children():
    # A runner started in the background (nohup, `cmd &` in a script) hands pytest SIGINT ignored,
    # and every child inherits that: the interrupt tests' Ctrl-C would then do nothing. Python's
    # own handler here is inherited by forked children, and an exec'd child starts at the default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(scope="session", autouse=True)
def _dfbuild_cache_env():
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    os.environ["DFBUILD_CACHE_DIR"] = str(TEST_CACHE)
    os.environ.setdefault("CCACHE_DIR", str(TEST_CACHE / "ccache"))
    os.environ.setdefault("CCACHE_MAXSIZE", "5G")
    # Every real llama.cpp build the tests make compiles at -O1: the same code and flags
    # otherwise, about half the compile time of -O3 on 2 cores (one cold build dominates
    # the CI run). Releases for users keep llama.cpp's -O3.
    os.environ.setdefault("DFBUILD_CMAKE_ARGS", TEST_CMAKE_ARGS)
    yield


@pytest.fixture(scope="session")
def test_cache() -> Path:
    return TEST_CACHE
