"""The output handler: engine outputs -> output processor -> every request's collector, run inside waiting streams.

There is no background task (so the frontend works on asyncio and trio alike): a stream that waits for its next
output takes the *turn* when nobody holds it, reads one batch of `EngineCoreOutputs` from the client and hands it
to the `OutputProcessor`, which fills every request's collector; the other waiting streams sleep on the notifier
until their collector has an output (only that stream wakes) or the turn is free (all wake). The role is that of
vLLM v1's `output_handler` task in `AsyncLLM` (`vllm/v1/engine/async_llm.py`).
"""

from __future__ import annotations

import logging
from collections import deque

import anyio

from asyncllm.engine.client import EngineCoreClient
from asyncllm.errors import EngineDeadError, EngineGenerateError, EventLoopError
from asyncllm.messages.engine import EngineCoreOutputs
from asyncllm.metrics.loggers import StatLoggerBase
from asyncllm.metrics.stats import IterationStats
from asyncllm.outputs import RequestOutput
from asyncllm.processing.output_processor import OutputProcessor
from asyncllm.streams import Notifier, RequestOutputCollector

logger = logging.getLogger(__name__)


class OutputHandler:
    """Moves engine outputs to collectors for one `AsyncLLM`, and knows whether its engine still serves.

    Args:
        client: the engine-core client outputs are read from (and stop-string aborts are sent to).
        output_processor: turns engine outputs into `RequestOutput`s in the collectors.
        stat_loggers: the `AsyncLLM`'s list (shared, so a caller's change to it applies).

    Attributes:
        notifier: wakes streams waiting for an output or for the turn.
        dead: the error that stopped the handler (sticky), or None.
        shut_down: True once `AsyncLLM.shutdown()` began.
    """

    def __init__(
        self, client: EngineCoreClient, output_processor: OutputProcessor, stat_loggers: list[StatLoggerBase]
    ) -> None:
        self.notifier = Notifier()
        self.dead: BaseException | None = None
        self.shut_down = False
        self._client = client
        self._output_processor = output_processor
        self._stat_loggers = stat_loggers
        self._handling = False  # a task holds the turn: it reads and processes engine outputs for every stream
        self._pending_batches: deque[EngineCoreOutputs] = deque()  # received, not yet processed (in order)

    @property
    def errored(self) -> bool:
        """True once the engine died (sticky)."""
        return self.dead is not None or self._client.errored

    def ensure_running(self) -> None:
        """Raises `EngineDeadError` (with the engine's own reason when known) if the engine died or was shut down."""
        if self.errored:
            raise EngineDeadError() from (self.dead or None)
        if self.shut_down:
            raise EngineDeadError("the engine was shut down")

    def forget_loop(self) -> None:
        """Drop per-loop state (waiters, the turn) of an event loop that ended."""
        self.notifier.reset()
        self._handling = False

    async def next_output(self, collector: RequestOutputCollector) -> RequestOutput:
        """Wait for `collector`'s next output, taking the turn to read engine outputs when it is free.

        Raises:
            EngineDeadError: the engine died or was shut down (the engine's own reason when it is known).
            EngineGenerateError: the request failed in the engine (from the collector).
        """
        while (output := collector.get_nowait()) is None:
            if self.errored or self.shut_down:  # an untracked stream of a dead engine would otherwise spin here
                self._client.check_health()  # the engine's own death reason, or "shut down"
                self.ensure_running()
            if self._handling:
                await self.notifier.wait(collector)
                continue
            # Holding the turn, this task waits on the engine's socket; anything put into its own collector
            # meanwhile (an abort's final output, a close, an error) ends that wait, as the engine may send
            # nothing more. Only the wait is cut short: processing a received batch is shielded.
            with anyio.CancelScope() as wait_scope:
                collector.wake_reader = wait_scope.cancel
                try:
                    await self._handle_engine_outputs()
                finally:
                    collector.wake_reader = None
        return output

    def abort_in_engine(self, request_ids: list[str]) -> None:
        """Send an abort for `request_ids` unless the engine is gone (then nothing runs for them anyway)."""
        if request_ids and not self.errored and not self.shut_down:
            self._client.abort_requests(request_ids)

    async def _handle_engine_outputs(self) -> None:
        """The turn's body: read a batch (cancellable: nothing is lost, a batch is taken from the socket without
        awaiting), then process every received batch shielded, so a cancelled consumer never drops others' outputs."""
        self._handling = True
        try:
            try:
                outputs = await self._client.get_output_async()
            except (anyio.get_cancelled_exc_class(), EventLoopError):
                raise
            except BaseException as e:
                self._stop_on_error(e)
                return
            self._pending_batches.append(outputs)
            self._pending_batches.extend(self._client.get_outputs_nowait())  # a lagging consumer's outputs merge
            with anyio.CancelScope(shield=True):
                while self._pending_batches:
                    self._process_batch_now(self._pending_batches.popleft())
                    await anyio.lowlevel.checkpoint()  # let other tasks run between engine steps
        finally:
            self._handling = False
            self.notifier.notify_all()  # the turn is free: whoever still waits takes it or finds its output

    def _stop_on_error(self, error: BaseException) -> None:
        if not self.shut_down:
            logger.error("the output handler stopped: %r", error)
            self.dead = error
        self._output_processor.propagate_error(error if isinstance(error, EngineDeadError) else EngineDeadError())

    def _process_batch_now(self, outputs: EngineCoreOutputs) -> None:
        """One engine step's outputs -> collectors (synchronously); stop-string hits -> engine aborts."""
        if outputs.failed_requests:
            processor = self._output_processor
            errors: dict[str, BaseException] = {
                i: EngineGenerateError(f"request {processor.external_id_of(i)!r}: {e}")
                for i, e in outputs.failed_requests.items()
            }
            self.abort_in_engine(processor.fail_requests(errors))  # the n > 1 siblings of a failed child
        iteration_stats = IterationStats() if self._stat_loggers else None
        result = self._output_processor.process_outputs(outputs.outputs, outputs.timestamp, iteration_stats)
        self.abort_in_engine(result.reqs_to_abort)
        self._record_stats(outputs, iteration_stats)

    def _record_stats(self, outputs: EngineCoreOutputs, iteration_stats: IterationStats | None) -> None:
        if outputs.utility_result is not None and not outputs.outputs:
            return
        for stat_logger in self._stat_loggers:
            try:
                stat_logger.record(outputs.scheduler_stats, iteration_stats)
            except Exception:  # a broken logger must not stop the output handler
                logger.exception("stat logger %r failed", stat_logger)
