"""The GPU engine of issue 64: one process per (model version, GPU) running the model for every
CPU worker of that version. protocol (the messages and their framing), arena (a worker's
shared-memory tensors), core (the queue, the batching loop, per-request retry), client (the
worker's side: in-process and over a Unix socket), serve (`python -m handlers.engine.serve`, the engine
process). Imports nothing of TorchServe, nor handlers/torchserve."""
