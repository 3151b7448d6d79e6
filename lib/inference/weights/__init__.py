"""Weight sync, one file a method, picked in sync.py (weight_sync_mode): the step's weights reach every server.

- reload.py: disk. The trainer writes weights/step_N (trainer/servable.py), each server reloads it.
- transfer.py: memory. The weights go over a process group (group.py) into each server's memory: vLLM's
  weight-transfer API with plainrl's gloo engine (vllm_transfer.py) on CPUs, NCCL on GPUs.
- The checks: fingerprint.py (a digest both ends compute), probing.py (served logprobs against the trainer's).
- The ends inside servers: vllm_worker.py (vLLM's worker extension); the builtin engine's is server/transfer.py.
Adding a method: a file here, and one branch in sync.py.
"""
