"""The output handler: engine outputs -> output processor -> every request's collector, in the background.

The client's output reader (`engine/client.py`: one background task per `AsyncLLM` on the loop it is used
from, an asyncio task or a trio system task) hands each batch of `EngineCoreOutputs` to `OutputHandler` as soon
as it is read, whether or not any stream waits: the `OutputProcessor` detokenizes, applies stop strings (sending
the aborts to the engine at once) and puts outputs into the request collectors; the stat loggers get every
step's stats. A stream waits on its own collector only, so an output wakes only the stream it is for. The role is
that of vLLM v1's `output_handler` task in `AsyncLLM` (`vllm/v1/engine/async_llm.py`).
"""

from __future__ import annotations

import logging

from asyncllm.engine.client import EngineCoreClient
from asyncllm.errors import EngineDeadError, EngineGenerateError
from asyncllm.messages.engine import EngineCoreOutputs
from asyncllm.metrics.loggers import StatLoggerBase
from asyncllm.metrics.stats import IterationStats
from asyncllm.outputs import RequestOutput
from asyncllm.processing.output_processor import OutputProcessor
from asyncllm.streams import RequestOutputCollector

logger = logging.getLogger(__name__)


class OutputHandler:
    """Moves engine outputs to collectors for one `AsyncLLM` (the client's output sink), and knows whether its
    engine still serves.

    Args:
        client: the engine-core client outputs are read from (and stop-string aborts are sent to); the handler
            sets itself as its output sink.
        output_processor: turns engine outputs into `RequestOutput`s in the collectors.
        stat_loggers: the `AsyncLLM`'s list (shared, so a caller's change to it applies).

    Attributes:
        dead: the error that stopped the handler (sticky), or None.
        shut_down: True once `AsyncLLM.shutdown()` began.
    """

    def __init__(
        self, client: EngineCoreClient, output_processor: OutputProcessor, stat_loggers: list[StatLoggerBase]
    ) -> None:
        self.dead: BaseException | None = None
        self.shut_down = False
        self._client = client
        self._output_processor = output_processor
        self._stat_loggers = stat_loggers
        client.set_output_sink(self)

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

    async def next_output(self, collector: RequestOutputCollector) -> RequestOutput:
        """Wait for `collector`'s next output (the output reader fills it in the background).

        Raises:
            EngineDeadError: the engine died or was shut down (the engine's own reason when it is known).
            EngineGenerateError: the request failed in the engine (from the collector).
        """
        while (output := collector.get_nowait()) is None:
            if self.errored or self.shut_down:  # an untracked stream of a dead engine would otherwise wait forever
                self._client.check_health()  # the engine's own death reason, or "shut down"
                self.ensure_running()
            await collector.wait()
        return output

    def abort_in_engine(self, request_ids: list[str]) -> None:
        """Send an abort for `request_ids` unless the engine is gone (then nothing runs for them anyway)."""
        if request_ids and not self.errored and not self.shut_down:
            self._client.abort_requests(request_ids)

    # ---- the client's output sink (called by its output reader, on the loop's thread) ------------------

    def expects_outputs(self) -> bool:
        """True while requests are in flight."""
        return self._output_processor.num_unfinished_requests > 0

    def stop(self, error: BaseException) -> None:
        """The output reader ended for good: every in-flight stream raises `EngineDeadError`."""
        if not self.shut_down and self.dead is None:
            logger.error("the output handler stopped: %r", error)
            self.dead = error
        self._output_processor.propagate_error(error if isinstance(error, EngineDeadError) else EngineDeadError())

    def process_outputs(self, outputs: EngineCoreOutputs) -> None:
        """One engine step's outputs -> collectors (synchronously); stop-string hits -> engine aborts; stats ->
        the stat loggers."""
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
