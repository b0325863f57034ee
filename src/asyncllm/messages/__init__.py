"""Every type that crosses a thread, process or socket boundary, and its wire encoding.

- `engine.py`: frontend <-> engine core: `EngineCoreRequest`, `EngineCoreOutputs`, request-type bytes,
  `FinishReason`, utility call/result, handshake, stats.
- `scheduler.py`: engine core -> workers: `SchedulerOutput`; workers -> engine core: `ModelRunnerOutput`.
- `rpc.py`: executor <-> worker calls (`RpcRequest`, `RpcResponse`).
- `serial.py`: the msgpack encoder/decoder with zero-copy array frames.

This package imports nothing else from asyncllm except the user-facing value types `SamplingParams` and
`PoolingParams` (`asyncllm.sampling_params`, `asyncllm.pooling_params`: leaves that import only
`asyncllm.errors`); `tests/unit/test_layering.py`
checks it.
"""
