"""Grammar compiles are bounded: a full compile queue answers 503, a slow compile 400."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from carpool.generation.structured import (
    ConstraintCompiler,
    GrammarBusy,
    GrammarTimeout,
    OutputConstraint,
)


class SlowCompiler(ConstraintCompiler):
    """Compiles nothing: each compile waits until the test releases it."""

    def __init__(self) -> None:
        super().__init__(tokenizer=None, vocab_size=8, stop_token_ids=[0])
        self.release = threading.Event()

    def _compile_now(self, constraint: OutputConstraint) -> Any:
        self.compiles += 1
        self.release.wait(10)
        return f"grammar for {constraint.schema}"


def schema(i: int) -> OutputConstraint:
    return OutputConstraint(kind="json_schema", schema=f'{{"title":"s{i}"}}')


def run_then_close(compiler: SlowCompiler, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run the test's coroutine; whatever happens, let blocked compiles finish and stop."""
    try:
        asyncio.run(main())
    finally:
        compiler.release.set()
        compiler.close()


def test_a_full_compile_queue_refuses_new_schemas_but_not_known_ones() -> None:
    compiler = SlowCompiler()

    async def main() -> None:
        waiting = [asyncio.create_task(compiler.compile_async(schema(i))) for i in range(3)]
        await asyncio.sleep(0.05)
        with pytest.raises(GrammarBusy):
            await compiler.compile_async(schema(99), timeout_s=5, max_waiting=3)
        # A schema already queued joins its compile instead of being refused.
        joined = asyncio.create_task(compiler.compile_async(schema(0), 5, max_waiting=3))
        compiler.release.set()
        assert await joined == 'grammar for {"title":"s0"}'
        await asyncio.gather(*waiting)

    run_then_close(compiler, main)
    assert compiler.compiles == 3


def test_a_slow_compile_times_out_and_lands_in_the_cache_later() -> None:
    compiler = SlowCompiler()

    async def main() -> None:
        with pytest.raises(GrammarTimeout):
            await compiler.compile_async(schema(1), timeout_s=0.05)
        compiler.release.set()
        # A loaded machine may take a while to run the compile thread: wait for it, bounded.
        for _ in range(200):
            if compiler.waiting() == 0:
                break
            await asyncio.sleep(0.05)
        # Compiled meanwhile: the next request gets it from the cache at once.
        assert await compiler.compile_async(schema(1), timeout_s=0.05) == (
            'grammar for {"title":"s1"}'
        )

    run_then_close(compiler, main)
    assert compiler.compiles == 1
