"""`StructuredOutputManager` and `GrammarState`: the grammar state of structured outputs, beside the scheduler.

Where the grammar state lives (as vLLM v1): in the engine core, next to the scheduler, not in the workers. The
submission-time checks and the xgrammar compiler are `structured_outputs/backend.py`; the packed bitmask the
workers apply is `structured_outputs/bitmask.py`.
- Compilation runs in a thread pool, never in the step loop. Compiled grammars are cached by constraint key
  (requests with the same schema share one compilation, even while it is running).
- A constrained request waits in `pending` (status WAITING_FOR_GRAMMAR, no KV blocks) until its grammar is
  ready; the scheduler then queues it like any other request, while the others keep running.
- Each request owns a `GrammarState` (its xgrammar matcher). Before a step, the manager fills one bitmask row per
  constrained request that samples in that step; the scheduler output carries the packed rows to every worker,
  so all tensor-parallel ranks apply the same mask. After the step, every sampled token advances the matcher.
- The vocabulary tables (importing xgrammar, which imports `transformers`; loading the tokenizer; xgrammar's
  `TokenizerInfo`) take seconds once per engine. They are built at engine start in a daemon thread, so the first
  constrained request does not wait for them (unless it comes within those seconds; it then waits for the rest).
- Preemption by recompute keeps a request's output tokens, so its matcher stays valid. `GrammarState.sync`
  still checks, before each mask, that the matcher has consumed exactly the request's output tokens, and rolls
  it back (or resets and replays) when the request holds fewer, so a scheduler that drops tokens stays correct.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from asyncllm.structured_outputs.bitmask import GrammarBitmask

if TYPE_CHECKING:
    from asyncllm.model.loading.tokenizer import Tokenizer
    from asyncllm.sched.request import Request
    from asyncllm.structured_outputs.backend import GrammarCompiler

logger = logging.getLogger(__name__)

Future = concurrent.futures.Future


class GrammarState:
    """One request's grammar matcher and how many output tokens it has consumed.

    Args:
        compiler: makes matchers.
        compiled: the request's compiled grammar.
    """

    def __init__(self, compiler: GrammarCompiler, compiled: Any) -> None:
        self._compiler = compiler
        self._compiled = compiled
        self.matcher = compiler.new_matcher(compiled)
        self.num_accepted = 0
        self.history: list[int] = []

    def accept(self, token_ids: list[int]) -> bool:
        """Advance over newly sampled tokens. Returns False (state unchanged from the first bad token on) if
        the grammar rejects one."""
        for token_id in token_ids:
            if not self.matcher.accept_token(token_id):
                return False
            self.history.append(token_id)
            self.num_accepted += 1
        return True

    @property
    def is_terminated(self) -> bool:
        """True once the grammar accepted its stop token: nothing more may be generated."""
        return bool(self.matcher.is_terminated())

    def sync(self, output_token_ids: list[int]) -> None:
        """Make the matcher's consumed tokens equal `output_token_ids`: roll back to the common prefix (or reset
        when rollback fails), then accept the rest."""
        if self.history == output_token_ids:
            return
        keep = 0
        for mine, theirs in zip(self.history, output_token_ids, strict=False):
            if mine != theirs:
                break
            keep += 1
        surplus = self.num_accepted - keep
        if surplus:
            try:
                self.matcher.rollback(surplus)
            except Exception:  # rollback window exceeded: start over
                self.matcher, keep = self._compiler.new_matcher(self._compiled), 0
        self.history, self.num_accepted = self.history[:keep], keep
        if not self.accept(output_token_ids[keep:]):
            logger.error("the grammar rejected tokens it had accepted before, while replaying them")

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this request's allowed next tokens into `bitmask[row]` ([rows, num_words] int32)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


class StructuredOutputManager:
    """Compiles grammars off the step loop and keeps the constrained requests' matchers.

    Args:
        tokenizer_loader: returns the model's tokenizer (called once, by the prebuild thread or the first compile).
        vocab_size: the model's logits width (bitmask rows cover it; padding ids are never allowed).
        max_workers: compile threads.
        prebuild: build the vocabulary tables now, in a daemon thread (when xgrammar is installed).
    Not thread-safe except for the compile jobs it runs itself: the engine core's thread calls every method.
    """

    def __init__(self, tokenizer_loader: Any, vocab_size: int, max_workers: int = 1, prebuild: bool = True) -> None:
        self._tokenizer_loader = tokenizer_loader
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._max_workers = max_workers
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._grammars: dict[tuple[str, str], Future[Any]] = {}
        self.pending: dict[str, Request] = {}
        self.num_compiled = 0
        self.prebuild_seconds: float | None = None  # how long the prebuild took, once done
        if prebuild and importlib.util.find_spec("xgrammar") is not None:
            threading.Thread(target=self._prebuild, name="asyncllm-grammar-prebuild", daemon=True).start()

    def _prebuild(self) -> None:
        start = time.perf_counter()
        try:
            self._get_compiler()
        except Exception:  # the first compile retries and reports it on its request
            logger.warning("building the grammar compiler's vocabulary tables failed", exc_info=True)
            return
        self.prebuild_seconds = time.perf_counter() - start
        logger.debug("grammar compiler ready in %.2f s", self.prebuild_seconds)

    # ---- compilation --------------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Start (or share) the compilation of the request's grammar; the request waits in `pending`."""
        params = req.sampling_params.structured_outputs
        assert params is not None  # the scheduler calls this only for constrained requests
        key = params.key
        future = self._grammars.get(key)
        if future is None or (future.done() and future.exception() is not None):
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self._max_workers, "asyncllm-grammar")
            future = self._pool.submit(self._compile, key)
            self._grammars[key] = future
        req.grammar_future = future
        self.pending[req.request_id] = req

    def _compile(self, key: tuple[str, str]) -> Any:
        compiled = self._get_compiler().compile(key)
        self.num_compiled += 1
        return compiled

    def _get_compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                from asyncllm.structured_outputs.backend import GrammarCompiler

                self._compiler = GrammarCompiler(self._tokenizer_loader(), self.vocab_size)
            return self._compiler

    def take_ready(self) -> tuple[list[Request], dict[Request, str]]:
        """Pending requests whose grammar is ready (each gets its `GrammarState`), and those whose grammar
        failed to compile (request -> error message). Both leave `pending`."""
        ready: list[Request] = []
        failed: dict[Request, str] = {}
        for req_id, req in list(self.pending.items()):
            future = req.grammar_future
            if future is None or not future.done():
                continue
            del self.pending[req_id]
            req.grammar_future = None
            error = future.exception()
            if error is not None:
                failed[req] = f"{type(error).__name__}: {error}"
                continue
            req.grammar = GrammarState(self._get_compiler(), future.result())
            ready.append(req)
        return ready, failed

    def wait_for_pending(self, timeout: float) -> None:
        """Block up to `timeout` seconds until some pending grammar is ready (so an idle step does not spin)."""
        futures = [req.grammar_future for req in self.pending.values() if req.grammar_future is not None]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def discard(self, req_ids: list[str]) -> list[Request]:
        """Drop pending requests (aborted while their grammar compiles); returns those that were pending."""
        return [req for req_id in req_ids if (req := self.pending.pop(req_id, None)) is not None]

    # ---- per step -----------------------------------------------------------------------------------

    def make_bitmask(self, reqs: list[Request]) -> GrammarBitmask | None:
        """One allowed-token row per constrained request in `reqs` (those about to sample), or None if none is
        constrained. Each matcher is first synced to its request's output tokens."""
        constrained = [req for req in reqs if req.grammar is not None]
        if not constrained:
            return None
        bitmask = torch.zeros((len(constrained), self.num_words), dtype=torch.int32)
        for row, req in enumerate(constrained):
            req.grammar.sync(req.output_token_ids)
            req.grammar.fill(bitmask, row)
        return GrammarBitmask.from_array([req.request_id for req in constrained], bitmask.numpy())

    def shutdown(self) -> None:
        """Stop the compile threads (running compilations finish; queued ones are dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def make_tokenizer_loader(model_path: str) -> Any:
    """A loader of the model's tokenizer for `StructuredOutputManager` (imported lazily)."""

    def load() -> Tokenizer:
        from asyncllm.model.loading.tokenizer import Tokenizer

        return Tokenizer.load(model_path)

    return load
