"""One copy of the weights per GPU: a holder process per (artifact, device, TorchServe frontend)
keeps the artifact's read-only weights in one allocation per dtype (holder.py), and each worker
on that device reads them in place, received as CUDA IPC handles (attach.py). The kind's loader
points the model at them (artifact/kinds: `held_weights`, `load(..., weights=...)`).
docs/shared-weights.md says what was measured and what was not."""
