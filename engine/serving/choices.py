"""The engine requests behind one API answer: one per prompt and sample, merged into one stream of updates.

Every choice (prompt i's sample j, index i * n + j as vLLM numbers them) is its own engine request, as
vLLM's parallel sampling makes them: they batch with the rest of the traffic and finish independently. The
answer ends when all have finished; if it ends early (client gone, an error, shutdown) `close` aborts
every one of them, so no sibling keeps holding KV blocks.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine.core.llm_engine import EngineDeadError
from engine.core.sampling_params import SamplingParams
from engine.frontend.output_processor import Resume
from engine.serving.async_engine import AsyncEngine
from engine.serving.errors import SERVER_ERROR, APIError, engine_error
from engine.serving.handles import RequestHandle
from engine.serving.messages import LogprobEntry, RequestOutput


@dataclass
class Choice:
    index: int
    handle: RequestHandle
    text: str = ""  # the text so far: every delta the engine thread sent, in order
    logprobs: list[LogprobEntry] = field(default_factory=list)  # every output token's, when asked for
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)  # the output's (return_token_ids)

    def advance(self, update: RequestOutput) -> str:
        """Take one engine message; returns its text delta. The last message sets `finish_reason`; an
        engine-ended request ("error": an unrecovered OOM; "abort") is a 503."""
        self.logprobs.extend(update.logprobs)
        self.token_ids.extend(update.token_ids)
        self.text += update.text
        reason = update.finish_reason
        if reason is not None and reason not in ("stop", "length"):
            raise APIError(503, f"the request was ended by the engine ({reason})", SERVER_ERROR, None, "engine_error")
        self.finish_reason = reason
        return update.text


async def submit(
    engine: AsyncEngine, requests: list[tuple[list[int], SamplingParams]], resume: Resume | None = None
) -> list[Choice]:
    """Add every request at once; if any is refused, abort those accepted and answer the first refusal. `resume`:
    the one request is a stream another replica began."""
    added = (engine.add(ids, params, resume) for ids, params in requests)
    results = await asyncio.gather(*added, return_exceptions=True)
    refused = [r for r in results if not isinstance(r, RequestHandle)]
    if refused:
        for r in results:
            if isinstance(r, RequestHandle):
                r.abort()
        raise engine_error(refused[0]) from refused[0]
    return [Choice(i, handle) for i, handle in enumerate(results)]


class ChoiceUpdates:
    """The updates of all choices in arrival order: one task per engine request feeds one queue, so a
    waiter can time out on `get` without losing an update."""

    def __init__(self, choices: list[Choice]) -> None:
        self.choices = choices
        self._queue: asyncio.Queue[tuple[Choice, RequestOutput | EngineDeadError]] = asyncio.Queue()
        self._open = len(choices)
        self._pumps = [asyncio.create_task(self._pump(c)) for c in choices]

    async def _pump(self, choice: Choice) -> None:
        try:
            async for update in choice.handle:
                self._queue.put_nowait((choice, update))
        except EngineDeadError as e:  # the loop died or stopped while this request ran
            self._queue.put_nowait((choice, e))

    @property
    def done(self) -> bool:
        return self._open == 0

    async def get(self) -> tuple[Choice, RequestOutput]:
        """The next update of any open choice (do not call once `done`)."""
        choice, item = await self._queue.get()
        if isinstance(item, EngineDeadError):
            raise engine_error(item) from item
        if item.finish_reason is not None:
            self._open -= 1
        return choice, item

    def __aiter__(self) -> ChoiceUpdates:
        return self

    async def __anext__(self) -> tuple[Choice, RequestOutput]:
        if self.done:
            raise StopAsyncIteration
        return await self.get()

    def close(self) -> None:
        """Idempotent: stop listening and abort every choice still running."""
        for task in self._pumps:
            task.cancel()
        for choice in self.choices:
            choice.handle.abort()
